"""Every option of every entry point, given a bad value, is refused at construction by an error that names it.

One table of bad values per option (:data:`BAD`), swept over each entry point that takes the option:
``AuditOptions``, the Lightning and Hugging Face callbacks, ``LoopAudit``, ``AuditConfig``, ``Auditor`` and
``audit()``; plus each entry point's own arguments (the model, the cadence, the hooks). An error must be a
``TypeError`` or ``ValueError`` whose message names the argument (``coverage=...``, ``sinks[0]=...``): never a
``ZeroDivisionError`` from inside, a bare ``TypeError`` of Python's, or a value accepted now that fails later.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from typing import Any, Callable

import pytest
import torch
from torch import nn

from weightsync_audit import AuditConfig, AuditOptions, Auditor, LoopAudit, audit
from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit

NAN, INF = math.nan, math.inf
_COVERAGE = ["1/0", "x", None, 0, 2, 0.3, [1], "1/-2", True]
BAD: dict[str, list[Any]] = {
    "include": [3, None, (), "weights", ("params", 3)],
    "exclude": [3, None, [3]],
    "on_mismatch": ["x", None, 3],
    "resync_src": [-1, "x", 1.5, None, True],
    "report_path": [123, b"audit.jsonl", "", "/no/such/dir/audit.jsonl"],
    "timeout_s": [0, -1, "x", True, NAN, INF],
    "coverage": _COVERAGE,
    "verbose": ["yes", None, 2],
    "tolerance": [-1, "x", NAN, True],
    "pinpoint": ["yes", None, 2],
    "pinpoint_ring": [0, "x", 1.5, True],
    "pinpoint_coverage": _COVERAGE,
    "checkpoints": ["yes", None, 2],
    "exit_code": [0, 256, "x", True],
    "sinks": [3, [3], "x"],
    "attribution": ["x", 3, {"nope": 1}],
    "overlap": ["yes", None, 1],
    # AuditConfig's, Auditor's and audit()'s own
    "method": ["x", None],
    "slices": [0, "x", 1.5],
    "pinpoint_slices": [0, "x"],
    "max_diff_tensors": [-1, "x"],
    "max_diff_bytes": [-1, "x"],
    "gap_budget_s": [0, "x", INF],
    "compare_broadcast_buffers": ["yes", 2],
    "ddp_broadcast_buffers": ["yes", 2],
    "check_finite": ["yes", 2],
    "step": ["x", 1.5],
    "epoch": ["x", 1.5],
}


def _named(message: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(=|\[\d+\]=|:)", message) is not None


def _refused(build: Callable[..., Any], name: str, value: Any, **extra: Any) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        build(**{name: value}, **extra)
    assert type(info.value) in (TypeError, ValueError), f"{name}={value!r}: {type(info.value).__name__}: {info.value}"
    assert _named(str(info.value), name), f"{name}={value!r}: the error does not name it: {info.value}"


def _hf() -> type:
    pytest.importorskip("transformers")
    from weightsync_audit.transformers import WeightSyncAuditCallback

    return WeightSyncAuditCallback


def _linear(**kw: Any) -> LoopAudit:
    return LoopAudit(nn.Linear(2, 2), **kw)


def _one_shot(**kw: Any) -> Any:
    return audit(nn.Linear(2, 2), **kw)


def _auditor_audit(**kw: Any) -> Any:
    position = {k: kw.pop(k) for k in ("step", "epoch") if k in kw}
    return Auditor(nn.Linear(2, 2), **kw).audit(**position)


ENTRY_POINTS: dict[str, Callable[..., Any]] = {
    "AuditOptions": AuditOptions,
    "WeightSyncAudit": WeightSyncAudit,
    "WeightSyncAuditCallback": lambda **kw: _hf()(**kw),
    "LoopAudit": _linear,
    "AuditConfig": AuditConfig,
    "Auditor": _auditor_audit,
    "audit": _one_shot,
}


def _takes(entry: str) -> list[str]:
    """The options of ``BAD`` an entry point takes by name (from its own signature or fields)."""
    target = {
        "AuditOptions": None,
        "AuditConfig": None,
        "WeightSyncAudit": WeightSyncAudit.__init__,
        "WeightSyncAuditCallback": None,
        "LoopAudit": LoopAudit.__init__,
        "Auditor": Auditor.__init__,
        "audit": audit,
    }[entry]
    if entry == "AuditOptions" or entry == "WeightSyncAuditCallback":
        names = [f.name for f in dataclasses.fields(AuditOptions)]
    elif entry == "AuditConfig":
        names = [f.name for f in dataclasses.fields(AuditConfig)]
    else:
        names = list(inspect.signature(target).parameters)
        if entry == "Auditor":
            names += ["step", "epoch"]  # Auditor.audit's
    return [n for n in names if n in BAD]


CASES = [(entry, name) for entry in ENTRY_POINTS for name in _takes(entry)]


@pytest.mark.parametrize(("entry", "name"), CASES, ids=[f"{e}-{n}" for e, n in CASES])
def test_every_bad_value_is_refused_naming_the_option(entry: str, name: str) -> None:
    extra: dict[str, Any] = {}
    if name == "exit_code":
        extra["on_mismatch"] = "raise"  # exit_code's own values; with warn it is refused for the pair
    for value in BAD[name]:
        _refused(ENTRY_POINTS[entry], name, value, **extra)


def test_the_sweep_covers_every_option_of_every_entry_point() -> None:
    # A new option joins the table, or this fails: every named argument of every entry point is swept.
    own = {"self", "options", "config", "module", "optimizer", "group", "every_n_train_steps", "hooks", "every_n_steps"}
    own |= {"check_batches", "unknown"}
    for entry in ENTRY_POINTS:
        if entry in ("AuditOptions", "WeightSyncAuditCallback"):
            names = [f.name for f in dataclasses.fields(AuditOptions)]
        elif entry == "AuditConfig":
            names = [f.name for f in dataclasses.fields(AuditConfig)]
        else:
            init = {"WeightSyncAudit": WeightSyncAudit.__init__, "LoopAudit": LoopAudit.__init__}
            names = list(
                inspect.signature(init.get(entry) or {"Auditor": Auditor.__init__, "audit": audit}[entry]).parameters
            )
        missing = [n for n in names if n not in BAD and n not in own]
        assert not missing, f"{entry}: options with no bad values in the sweep: {missing}"


def test_exit_code_without_raise_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"exit_code=17 .*on_mismatch='raise', not 'warn'"):
        AuditOptions(exit_code=17)


@pytest.mark.parametrize("module", [None, torch.zeros(3), "model.pt"], ids=["None", "tensor", "str"])
def test_loop_audit_refuses_what_is_no_model_at_construction(module: Any) -> None:
    with pytest.raises(TypeError, match=r"^module="):
        LoopAudit(module)
    with pytest.raises(TypeError, match=r"optimizer\[0\]"):
        LoopAudit(nn.Linear(2, 2), "adam")
    _refused(_linear, "check_batches", "yes")
    _refused(_linear, "every_n_steps", 0)


@pytest.mark.parametrize(
    ("build", "name", "values"),
    [
        (WeightSyncAudit, "every_n_train_steps", [0, "x", True]),
        (WeightSyncAudit, "hooks", [("on_train_batch_middle",), 3]),
        (lambda **kw: _hf()(**kw), "every_n_steps", [0, "x", True]),
    ],
    ids=["lightning-cadence", "lightning-hooks", "hf-cadence"],
)
def test_the_adapters_own_arguments_are_refused_naming_them(build: Any, name: str, values: list[Any]) -> None:
    for value in values:
        _refused(build, name, value)


def test_the_variables_typo_suggests_the_option_and_lists_only_real_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync_audit.integrations.activation import parse_options

    with pytest.raises(ValueError) as info:
        parse_options("every_n_train_step=50")
    message = str(info.value)
    assert "did you mean every_n_train_steps?" in message
    listed = message.split("(options: ")[1].rstrip(")").split(", ")
    assert listed == [p for p in inspect.signature(WeightSyncAudit.__init__).parameters][1:-2]  # no `unknown`
    monkeypatch.setenv("WEIGHTSYNC_AUDIT", "overlap=true,attribution=yes,coverage=1/0")
    from weightsync_audit.integrations.activation import callbacks_from_env

    with pytest.raises(ValueError, match=r"coverage='1/0'"):
        callbacks_from_env(WeightSyncAudit)


def _torchft(**kw: Any) -> Any:
    from weightsync_audit.integrations.torchft.audit import TorchFTAudit

    return TorchFTAudit(None, **kw)  # the option is answered before the manager is looked at


MISSPELT: dict[str, Callable[..., Any]] = {
    **ENTRY_POINTS,
    "Auditor.audit": lambda **kw: Auditor(nn.Linear(2, 2)).audit(**kw),
    "TorchFTAudit": _torchft,
}


@pytest.mark.parametrize("entry", list(MISSPELT))
def test_every_entry_point_answers_a_misspelt_option_with_the_one_meant(entry: str) -> None:
    misspelt, meant = ("stpe", "step") if entry == "Auditor.audit" else ("tolerence", "tolerance")
    with pytest.raises(TypeError, match=rf"got an unexpected option {misspelt}=0.5: did you mean {meant}=0.5\?"):
        MISSPELT[entry](**{misspelt: 0.5})


@pytest.mark.parametrize("entry", ["LoopAudit", "TorchFTAudit", "WeightSyncAuditCallback", "WeightSyncAudit"])
def test_the_other_frameworks_cadence_name_is_answered_with_this_ones(entry: str) -> None:
    own = "every_n_train_steps" if entry == "WeightSyncAudit" else "every_n_steps"
    other = "every_n_steps" if entry == "WeightSyncAudit" else "every_n_train_steps"
    with pytest.raises(TypeError, match=rf"{other}=5: did you mean {own}=5\? \({other} is "):
        MISSPELT[entry](**{other: 5})


def test_flat_settings_beside_a_whole_config_or_options_are_refused_naming_each() -> None:
    model = nn.Linear(2, 2)
    config = AuditConfig(include=("params",))
    with pytest.raises(TypeError, match=r"config= and coverage=, tolerance= both given: set them in the AuditConfig"):
        Auditor(model, config=config, tolerance=0.1, coverage="1/4")
    with pytest.raises(TypeError, match=r"config= and pinpoint= both given: set pinpoint in the AuditConfig"):
        Auditor(model, config=config, pinpoint=True)
    assert Auditor(model, config=config, include=("params", "buffers", "optimizer")).config is config  # defaults
    with pytest.raises(TypeError, match=r"options= and verbose=, tolerance= both given: set them in the AuditOptions"):
        LoopAudit(model, options=AuditOptions(), tolerance=0.1, verbose=False)
