"""The Hugging Face Trainer callback, Fabric, Accelerate and bare torchrun loops, on 2 real gloo ranks.

One launch runs every scenario (tests/scripts/trainers_run.py, the ``trainer_runs`` fixture of
tests/conftest.py, shared with tests/test_hf_unfreeze.py): ``torchrun`` twice, as two one-process
"nodes" rendezvousing on 127.0.0.1, so every local rank is 0 while the global ranks are 0 and 1. Tiny
models built locally (a 2-layer GPT-2 of width 32), no hub downloads, no reporting integrations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def runs(trainer_runs: dict[str, Any]) -> dict[str, Any]:
    return trainer_runs  # one launch for the session (tests/conftest.py), shared with tests/test_hf_unfreeze.py


def scenario(runs: dict[str, Any], name: str) -> dict[int, Any]:
    got = runs.get(name)
    assert got is not None and set(got) == {0, 1}, f"{name}: not every rank reported\n{runs['log']}"
    for rank, out in got.items():
        assert "error" not in out, f"{name} on rank {rank}: {out['error']}\n{out.get('traceback')}"
    return got


def test_every_rank_exits_0_and_global_ranks_are_right_though_both_local_ranks_are_0(runs: dict[str, Any]) -> None:
    assert runs["codes"] == [0, 0], runs["log"]
    for rank, out in scenario(runs, "torchrun_loop").items():
        assert (out["rank"], out["local_rank"], out["node"]) == (rank, 0, rank)


def test_hf_trainer_healthy_run_every_record_in_sync_with_params_and_optimizer_state_compared(
    runs: dict[str, Any],
) -> None:
    got = scenario(runs, "hf_healthy")
    records = got[0]["records"]
    hooks = [r["hook"] for r in records]
    assert (
        hooks[0] == "on_train_begin" and hooks.count("on_step_end") == 6 and hooks.count("on_pre_optimizer_step") == 6
    )
    assert all(r["in_sync"] and r["world_size"] == 2 for r in records)
    after_first_step = [r for r in records if r["hook"] == "on_step_end"]
    # Adam's exp_avg, exp_avg_sq and step for each of the 28 parameters, plus the group's settings.
    assert all(r["checked"]["param"] == 28 and r["checked"]["optimizer"] > 3 * 28 for r in after_first_step)
    assert all(r["checked"]["grad"] == 28 for r in records if r["hook"] == "on_pre_optimizer_step")
    for out in got.values():
        assert [e["step"] for e in out["logged"]] == [1, 2, 3, 4, 5, 6]  # one metric line per logged step
        assert all(e["weightsync/in_sync"] == 1.0 and e["weightsync/diverged_tensors"] == 0 for e in out["logged"])
        assert "in sync throughout" in out["summary"]


def test_hf_trainer_weight_nudged_on_rank_1_makes_every_rank_raise_naming_it_within_seconds(
    runs: dict[str, Any],
) -> None:
    for out in scenario(runs, "hf_raise").values():
        assert out["raised"] == "WeightDivergenceError"
        assert out["step"] == 3 and out["names"] == ["transformer.h.1.mlp.c_fc.weight"] and out["ranks"] == [[1]]
        assert "transformer.h.1.mlp.c_fc.weight" in out["message"]
        assert out["seconds_after_the_nudge"] < 10


def test_hf_trainer_saves_a_verified_sidecar_and_a_resume_names_the_rank_that_holds_another_head(
    runs: dict[str, Any],
) -> None:
    from weightsync_audit.cli import main

    got = scenario(runs, "hf_checkpoint")[0]
    [save] = [r for r in got["saved"] if r.get("checkpoint")]
    assert save["hook"] == "on_save" and save["checkpoint"]["status"] == "verified" and save["step"] == 3
    assert main(["verify", got["folder"]]) == 0
    start = got["resumed"][0]
    assert start["hook"] == "on_train_begin" and start["checkpoint"]["status"] == "changed"
    named = {(m["name"], tuple(m["ranks"]), tuple(m["reference_ranks"])) for m in start["mismatches"]}
    assert ("transformer.h.1.mlp.c_fc.weight", (1,), (0,)) in named
    assert any("saved at step 3" in (m["detail"] or "") for m in start["mismatches"])


def test_hf_trainer_resync_repairs_the_nudge_and_ends_bit_identical(runs: dict[str, Any]) -> None:
    got = scenario(runs, "hf_resync")
    records = got[0]["records"]
    assert [r["action"] for r in records if not r["in_sync"]] == ["resynced"]
    assert all(r["in_sync"] for r in records if r["step"] > 3)
    assert got[0]["digests"][0] == got[0]["digests"][1]


def test_hf_trainer_with_pinpoint_audited_every_5_steps_names_step_3_where_the_nudge_was(
    runs: dict[str, Any],
) -> None:
    records = scenario(runs, "hf_pinpoint")[0]["records"]
    first_bad = next(r for r in records if not r["in_sync"])
    assert first_bad["step"] == 5 and all(r["in_sync"] for r in records if r["step"] < 5)
    assert (first_bad["pinpoint"], first_bad["first_diverged_step"], first_bad["last_in_sync_step"]) == ("exact", 3, 2)


def test_hf_trainer_batchnorm_no_false_alarm_under_default_ddp_and_real_buffers_without_broadcast(
    runs: dict[str, Any],
) -> None:
    got = scenario(runs, "hf_batchnorm")[0]
    default, no_broadcast = got["default"], got["no_broadcast"]
    assert all(r["in_sync"] for r in default)
    assert all("broadcast_buffers=True" in " ".join(r["notes"]) for r in default)
    diverged = [r for r in no_broadcast if not r["in_sync"]]
    assert diverged and diverged[0]["step"] == 1
    assert {(m["name"], m["kind"], tuple(m["ranks"])) for m in diverged[0]["mismatches"]} == {
        ("body.1.running_mean", "buffer", (1,)),
        ("body.1.running_var", "buffer", (1,)),
    }


def test_hf_trainer_lr_changed_on_one_rank_is_reported_by_the_grads_time_audit(runs: dict[str, Any]) -> None:
    records = scenario(runs, "hf_lr")[0]["records"]
    first = next(r for r in records if not r["in_sync"])
    assert (first["hook"], first["step"]) == ("on_pre_optimizer_step", 3)
    assert [(m["name"], m["kind"], m["ranks"]) for m in first["mismatches"]] == [
        ("param_groups.0.lr", "optimizer", [1])
    ]


def _lr_truth(lr: list[dict[str, dict[str, float]]], when: str) -> dict[int, list[int]]:
    """From every rank's own reading of its lr (``pre_step``: as the step read it; ``step_end``: after the
    scheduler), the steps at which the ranks disagreed, with the ranks that differ from rank 0."""
    steps = sorted(int(s) for s in lr[0][when])
    out = {}
    for s in steps:
        odd = [r for r in range(len(lr)) if lr[r][when][str(s)] != lr[0][when][str(s)]]
        if odd:
            out[s] = odd
    return out


def test_hf_trainer_lr_changed_for_one_step_is_named_by_the_audit_after_it_though_the_scheduler_set_it_back(
    runs: dict[str, Any],
) -> None:
    got = scenario(runs, "hf_lr_at_step_only")[0]
    read, after = _lr_truth(got["lr"], "pre_step"), _lr_truth(got["lr"], "step_end")
    assert list(read) == [3] and after == {}  # the truth: step 3 read another lr on rank 1, set back by its end
    records = got["records"]
    first = next(r for r in records if not r["in_sync"])
    assert (first["hook"], first["step"]) == ("on_step_end", 3)
    [lr] = [m for m in first["mismatches"] if m["name"] == "param_groups.0.lr"]
    assert lr["kind"] == "optimizer" and lr["ranks"] == read[3] and "optimizer step 3" in lr["detail"]
    assert first["hints"][0].startswith("The learning rate differed as optimizer step 3 read it (param_groups.0.lr")
    # The same evidence while the parameters stay apart; never "no optimizer step parted them".
    assert all(any(m["name"] == "param_groups.0.lr" for m in r["mismatches"]) for r in records if not r["in_sync"])
    assert not any("no optimizer step parted them" in h for r in records for h in r["hints"])


def _changes(records: list[dict[str, Any]]) -> int:
    """Real changes: per kind of audit (the gradients' before the step, the weights' after it), each time the
    set of diverged tensors appears or changes; a divergence resynced again with the same names is none."""
    last: dict[str, tuple[str, ...]] = {}
    changes = 0
    for r in records:
        kind = "grads" if r["hook"] == "on_pre_optimizer_step" else "main"
        names = tuple(m["name"] for m in r["mismatches"])
        if names and names != last.get(kind, ()):
            changes += 1
        last[kind] = names
    return changes


@pytest.mark.parametrize("on_mismatch", ["warn", "resync"])
def test_hf_trainer_lr_differing_at_every_step_is_reported_once_per_real_change_with_true_reasons(
    runs: dict[str, Any], on_mismatch: str
) -> None:
    got = scenario(runs, f"hf_lr_every_step_{on_mismatch}")[0]
    read = _lr_truth(got["lr"], "pre_step")
    assert sorted(read) == list(range(1, 9)) and all(odd == [1] for odd in read.values())  # every step, rank 1
    records, printed = got["records"], got["printed"]
    pre = [r for r in records if r["hook"] == "on_pre_optimizer_step"]
    assert len(pre) == 8 and all(not r["in_sync"] for r in pre)
    # One full report per real change, however the two kinds of audit alternate: 8 steps of them make 2
    # under warn (the lr before the step, the parameters that followed after it), 1 under resync.
    reports = printed.count(": DIVERGED,")
    assert reports == _changes(records) == {"warn": 2, "resync": 1}[on_mismatch], printed
    if on_mismatch == "resync":
        assert all(r["action"] == "resynced" for r in pre)
        assert [n for n in range(2, 9) if f"resynced again, {n} times, same cause" in printed] == list(range(2, 9))
        assert len(got["warned"]) == 1 and "the cause persists" in got["warned"][0]
    # True reasons: on plain DDP every parameter has a replica (the audits after the step compared them); the
    # gradient audit before the step does not compare parameters, and says that, not "held by one rank only".
    assert all(r["checked"]["param"] == 28 for r in records if r["hook"] == "on_step_end")
    hints = [h for r in pre for h in r["hints"]]
    assert hints and not any("held by one rank only" in h for h in hints)
    assert all("does not compare the parameters" in r["hints"][0] for r in pre)


@pytest.mark.parametrize(
    ("loop", "wrapper", "planted"),
    [
        ("fabric_loop", "_FabricModule", "head.bias"),
        ("accelerate_loop", "DistributedDataParallel", "backbone.bias"),
        ("torchrun_loop", "DistributedDataParallel", "backbone.weight"),
    ],
)
def test_plain_loops_in_sync_then_a_planted_change_named_with_the_users_names(
    runs: dict[str, Any], loop: str, wrapper: str, planted: str
) -> None:
    for out in scenario(runs, loop).values():
        assert out["wrapper"] == wrapper
        results = out["results"]
        assert [r["in_sync"] for r in results] == [True, True, False, False]
        assert results[1]["checked"]["optimizer"] > 0
        for r in results[2:]:
            assert [(m["name"], m["ranks"], m["reference_ranks"]) for m in r["mismatches"]] == [(planted, [1], [0])]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"every_n_steps": 0}, "every_n_steps=0"),
        ({"every_n_steps": True}, "every_n_steps=True"),
        ({"include": ("params", "weights")}, "include="),
        ({"on_mismatch": "ignore"}, "on_mismatch='ignore'"),
        ({"resync_src": -1}, "resync_src=-1"),
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"coverage": 0.3}, "coverage=0.3"),
        ({"report_path": "/no/such/dir/audit.jsonl"}, "report_path"),
    ],
)
def test_hf_callback_checks_its_arguments_at_construction_naming_them(kwargs: dict[str, Any], named: str) -> None:
    from weightsync_audit.transformers import WeightSyncAuditCallback

    with pytest.raises((ValueError, TypeError)) as info:
        WeightSyncAuditCallback(**kwargs)
    assert named in str(info.value)


def test_hf_callback_is_a_trainer_callback() -> None:
    from transformers import TrainerCallback

    from weightsync_audit.transformers import WeightSyncAuditCallback

    assert issubclass(WeightSyncAuditCallback, TrainerCallback)


def _flat_options(init: Any, own: tuple[str, ...]) -> list[tuple[str, Any]]:
    """An adapter's flat keyword arguments after its own (``own``), with their defaults, in order."""
    import inspect

    params = [p for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
    names = [p.name for p in params]
    assert names[-1] == "options" and names[: len(own)] == list(own), names
    return [(p.name, p.default) for p in params[len(own) : -1]]


def test_every_adapters_flat_options_are_the_one_audit_options_definition() -> None:
    import dataclasses

    from weightsync_audit import AuditOptions, LoopAudit
    from weightsync_audit.integrations.lightning.audit_callback import WeightSyncAuditMixin
    from weightsync_audit.transformers import WeightSyncAuditCallback

    # Names, defaults and order of the flat signatures, checked against AuditOptions' fields.
    fields = [(f.name, f.default) for f in dataclasses.fields(AuditOptions)]
    # Lightning hands its callbacks the batch: it compares batches too (the Hugging Face Trainer does not).
    lightning = [*fields, ("check_batches", False)]
    assert _flat_options(WeightSyncAuditMixin.__init__, ("self", "every_n_train_steps", "hooks")) == lightning
    assert _flat_options(WeightSyncAuditCallback.__init__, ("self", "every_n_steps")) == fields
    # LoopAudit has no Trainer to save checkpoints (it has checkpoint_saved), and compares batches.
    loop = [f for f in fields if f[0] != "checkpoints"] + [("check_batches", False)]
    assert _flat_options(LoopAudit.__init__, ("self", "module", "optimizer", "every_n_steps")) == loop


def test_an_adapter_takes_its_options_whole_or_flat_never_both(tmp_path: Path) -> None:
    import dataclasses

    import torch

    from weightsync_audit import AuditOptions, LoopAudit
    from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit
    from weightsync_audit.transformers import WeightSyncAuditCallback

    options = AuditOptions(include=["params"], on_mismatch="raise", report_path=tmp_path / "a.jsonl", exit_code=17)
    assert options.include == ("params",) and options.report_path == str(tmp_path / "a.jsonl")
    for cb in (
        WeightSyncAudit(options=options),
        WeightSyncAuditCallback(options=options),
        LoopAudit(torch.nn.Linear(2, 2), options=options),
    ):
        assert cb.options is options and cb.runner.options is options
        assert (cb.include, cb.on_mismatch, cb.exit_code, cb.runner.report_path) == (
            ("params",),
            "raise",
            17,
            str(tmp_path / "a.jsonl"),
        )
    assert WeightSyncAudit(on_mismatch="raise").options == AuditOptions(on_mismatch="raise")
    with pytest.raises(TypeError, match="options= and verbose= both given"):
        WeightSyncAuditCallback(verbose=False, options=options)
    with pytest.raises(TypeError, match="options="):
        WeightSyncAudit(options={"on_mismatch": "raise"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exit_code=17 acts on a divergence under on_mismatch='raise'"):
        AuditOptions(exit_code=17)
    with pytest.raises(TypeError, match="overlap=1"):
        AuditOptions(overlap=1)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.verbose = False  # type: ignore[misc]
