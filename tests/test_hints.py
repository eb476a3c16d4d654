"""Root-cause hints: each recognisable cause of drift, made to happen on real gloo ranks, then audited.

A cause the wrapper proves is stated as fact; a cause guessed from the pattern says "likely".
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch._dynamo  # DDP imports it lazily at construction: once here, not in every forked rank
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from weightsync_audit import Auditor, audit


def make_model(batchnorm: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 8)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(8))
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(8, 3))


def local_step(net: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    """One step on data that differs per rank (as data-parallel batches do)."""
    torch.manual_seed(100 + rank)
    opt.zero_grad(set_to_none=True)
    (net(torch.randn(4, 6)) - 1).pow(2).mean().backward()
    opt.step()


def _unfrozen_after_wrap(rank: int, world: int) -> dict:
    model = make_model()
    model[0].requires_grad_(False)  # frozen when DDP builds its reducer
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local_step(ddp, opt, rank)
    model[0].requires_grad_(True)  # unfrozen later: the reducer never learns of it
    for _ in range(2):
        local_step(ddp, opt, rank)
    grads = Auditor(include=("grads",)).audit(ddp, step=3)
    return {"params": audit(ddp, opt, step=3).to_dict(), "grads": grads.to_dict()}


def test_plain_ddp_unfrozen_after_the_wrap_gets_the_ddp_hint_naming_the_parameters_and_the_fix() -> None:
    out = run_ranks(_unfrozen_after_wrap, 2)
    rec = out[0]["params"]
    assert out[0]["params"]["hints"] == out[1]["params"]["hints"]  # every rank says the same
    assert sorted(m["name"] for m in rec["mismatches"]) == ["0.bias", "0.weight"]
    hint = rec["hints"][0]
    assert "0.weight" in hint and "0.bias" in hint and "2.weight" not in hint
    assert "require grad, but DistributedDataParallel does not all-reduce their gradients" in hint
    assert "became trainable after DDP wrapped the model" in hint
    assert "DDPRewrapOnTrainableChange" in hint and "maybe_rewrap" in hint
    assert "likely" not in hint  # proven from the reducer, not guessed
    assert len(rec["hints"]) == 1  # the proven cause explains every mismatch
    # The gradients tell the same story, with the same hint.
    grads = out[0]["grads"]
    assert sorted(m["name"] for m in grads["mismatches"]) == ["0.bias", "0.weight"]
    assert "does not all-reduce their gradients" in grads["hints"][0]


def _frozen_after_wrap(rank: int, world: int) -> dict:
    model = make_model()
    ddp = DDP(model)  # find_unused_parameters=False
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local_step(ddp, opt, rank)
    model[2].requires_grad_(False)  # its bucket never completes: the gradients sharing it stay local
    local_step(ddp, opt, rank)
    return audit(ddp, opt).to_dict()


def test_parameters_frozen_after_the_wrap_get_the_stalled_bucket_hint() -> None:
    rec = run_ranks(_frozen_after_wrap, 2)[0]
    assert not rec["in_sync"]
    assert "2.weight, 2.bias were frozen after DistributedDataParallel wrapped the model" in rec["hints"][0]
    assert "never all-reduced" in rec["hints"][0]


def _batchnorm_without_broadcast(rank: int, world: int) -> dict:
    model = make_model(batchnorm=True)
    ddp = DDP(model, broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # params stay equal; only the statistics move
    local_step(ddp, opt, rank)
    return audit(ddp, opt).to_dict()


def test_batchnorm_buffers_with_broadcast_buffers_false_are_reported_as_buffers_with_the_setting() -> None:
    rec = run_ranks(_batchnorm_without_broadcast, 2)[0]
    kinds = {m["name"]: m["kind"] for m in rec["mismatches"]}
    assert kinds == {"1.running_mean": "buffer", "1.running_var": "buffer"}
    [hint] = rec["hints"]
    assert "broadcast_buffers=False" in hint and "1.running_mean" in hint


def _buffer_without_ddp(rank: int, world: int) -> dict:
    model = make_model(batchnorm=True)
    model.train()
    torch.manual_seed(rank)
    model(torch.randn(4, 6))  # a forward on local data updates the running statistics
    return audit(model).to_dict()


def test_differing_buffers_without_a_ddp_wrapper_get_a_likely_hint() -> None:
    rec = run_ranks(_buffer_without_ddp, 2)[0]
    [hint] = rec["hints"]
    assert "Buffers 1.running_mean, 1.running_var differ: likely statistics updated from each rank's local data" in hint


def _lr_differs(rank: int, world: int) -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 1:
        opt.param_groups[0]["lr"] = 0.05  # a scheduler stepped once more here
    return audit(DDP(model), opt).to_dict()


def _optimizer_state_differs(rank: int, world: int) -> dict:
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    local_step(ddp, opt, 0)
    if rank == 1:
        opt.state[model[2].weight]["exp_avg"].zero_()  # reset on one rank only
    return audit(ddp, opt).to_dict()


def _params_differ_grads_agree(rank: int, world: int) -> dict:
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local_step(ddp, opt, rank)  # DDP averages: every rank has the same gradients now
    if rank == 1:
        with torch.no_grad():
            model[2].bias.add_(0.5)  # edited on one rank, outside training
    return audit(ddp, include=("params", "grads")).to_dict()


@pytest.mark.parametrize(
    ("worker", "mismatched", "said"),
    [
        (
            _lr_differs,
            [("param_groups.0.lr", "optimizer")],
            "learning rate differs (param_groups.0.lr) while the parameters still agree: likely",
        ),
        (
            _optimizer_state_differs,
            [("2.weight.exp_avg", "optimizer")],
            "Optimizer state differs (2.weight.exp_avg) while the parameters still agree: likely",
        ),
        (_params_differ_grads_agree, [("2.bias", "param")], "Gradients agree but parameters differ (2.bias): likely"),
    ],
    ids=[
        "learning rate differs while params agree: a scheduler",
        "optimizer state differs while params agree",
        "params differ while grads agree",
    ],
)
def test_one_kind_differing_while_another_agrees_gets_its_likely_hint(
    worker: Callable[[int, int], dict], mismatched: list[tuple[str, str]], said: str
) -> None:
    rec = run_ranks(worker, 2)[0]
    assert [(m["name"], m["kind"]) for m in rec["mismatches"]] == mismatched
    [hint] = rec["hints"]
    assert said in hint


def _frozen_param_edited(rank: int, world: int) -> dict:
    model = make_model()
    model[0].requires_grad_(False)
    ddp = DDP(model)
    if rank == 1:
        with torch.no_grad():
            model[0].weight.mul_(2)  # e.g. a checkpoint loaded on one rank after the wrap
    return audit(ddp).to_dict()


def test_frozen_params_that_differ_get_the_loaded_on_some_ranks_hint() -> None:
    rec = run_ranks(_frozen_param_edited, 2)[0]
    [hint] = rec["hints"]
    assert "0.weight differ but do not require grad" in hint and "likely" in hint


def _ignored_by_ddp(rank: int, world: int) -> dict:
    model = make_model()
    model._ddp_params_and_buffers_to_ignore = ["2.bias"]
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local_step(ddp, opt, rank)
    return audit(ddp).to_dict()


def test_parameters_ddp_was_told_to_ignore_get_the_ignore_list_hint() -> None:
    rec = run_ranks(_ignored_by_ddp, 2)[0]
    assert [m["name"] for m in rec["mismatches"]] == ["2.bias"]
    [hint] = rec["hints"]
    assert "2.bias are in DistributedDataParallel's parameters_to_ignore" in hint


def _structure(rank: int, world: int) -> dict:
    model = make_model()
    if rank == 1:
        model.append(nn.Linear(3, 3))  # a per-rank configuration
    return audit(model).to_dict()


def test_structure_differences_get_a_likely_hint_naming_the_tensors() -> None:
    rec = run_ranks(_structure, 2)[0]
    assert {m["kind"] for m in rec["mismatches"]} == {"structure"}
    [hint] = rec["hints"]
    assert "differs in structure between ranks (3.weight, 3.bias" in hint and "likely" in hint


def _in_sync(rank: int, world: int) -> dict:
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local_step(ddp, opt, rank)
    return audit(ddp, opt).to_dict()


def test_replicas_in_sync_get_no_hints() -> None:
    rec = run_ranks(_in_sync, 2)[0]
    assert rec["in_sync"] and rec["hints"] == []


# -- evidence that rules a cause out, and the optimizer actually in use ---------------------------


def _nudged_under_ddp(rank: int, world: int) -> dict:
    out = {}
    for name, make_opt in (
        ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2)),
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1)),
    ):
        model = make_model()
        ddp = DDP(model)  # its reducer covers every parameter
        opt = make_opt(model.parameters())
        for _ in range(2):
            local_step(ddp, opt, rank)  # DDP averages: the parameters and the Adam moments stay equal
        if rank == 1:
            with torch.no_grad():
                model[0].weight[3, 5] += 1e-3  # a planted nudge, outside training
        out[name] = audit(ddp, opt).to_dict()
    return out


def test_a_nudge_under_ddp_gets_no_hint_the_reducer_or_the_agreeing_optimizer_state_rules_out() -> None:
    got = run_ranks(_nudged_under_ddp, 2)[0]
    adam = got["adam"]
    assert [(m["name"], m["kind"]) for m in adam["mismatches"]] == [("0.weight", "param")]
    [hint] = adam["hints"]
    # DDP's reducer covers 0.weight, and its Adam moments were compared and agree: its gradients were
    # all-reduced, so no gradient cause may be named, only what is left.
    assert "trainable set changed" not in hint and "not all-reduced" not in hint and "without DDP" not in hint
    assert "0.weight" in hint and "exp_avg, exp_avg_sq" in hint and "agrees" in hint
    assert "edited, loaded or initialised on some ranks only" in hint and "likely" in hint
    # Plain SGD keeps no state: the gradients stay a suspect (no_sync), but not the causes DDP rules out.
    [hint] = got["sgd"]["hints"]
    assert "Parameters 0.weight differ: likely" in hint and "no_sync() misuse" in hint
    assert "trainable set changed" not in hint and "without DDP" not in hint


def _unfrozen_with(rank: int, world: int) -> dict:
    out = {}
    for name, make_opt in (
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1)),
        ("momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
        ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2)),
    ):
        model = make_model()
        model[0].requires_grad_(False)
        ddp = DDP(model)
        model[0].requires_grad_(True)  # outside the reducer: stepped from local gradients
        opt = make_opt(model.parameters())
        for _ in range(2):
            local_step(ddp, opt, rank)
        [hint] = [h for h in audit(ddp, opt).hints if "does not all-reduce" in h]
        out[name] = hint
    return out


def test_the_resync_advice_names_the_optimizer_state_in_use_and_never_an_optimizer_that_is_not() -> None:
    got = run_ranks(_unfrozen_with, 2)[0]
    for hint in got.values():
        assert "resync it once, optimizer state included" in hint and "Adam" not in hint
    assert "exp_avg" not in got["sgd"] and "momentum_buffer" not in got["sgd"]
    assert "any state the optimizer keeps per parameter" in got["sgd"]
    assert "momentum_buffer" in got["momentum"] and "exp_avg" not in got["momentum"]
    assert "exp_avg, exp_avg_sq" in got["adam"] and "momentum_buffer" not in got["adam"]


def _grads_left_local_under_ddp(rank: int, world: int) -> dict:
    model = make_model()
    ddp = DDP(model)
    torch.manual_seed(100 + rank)
    with ddp.no_sync():  # accumulation without the final synced backward: the gradients stay local
        (ddp(torch.randn(4, 6)) - 1).pow(2).mean().backward()
    return audit(ddp, include=("grads",)).to_dict()


def test_gradients_differing_under_a_live_ddp_wrapper_do_not_blame_a_missing_wrapper() -> None:
    rec = run_ranks(_grads_left_local_under_ddp, 2)[0]
    assert {m["kind"] for m in rec["mismatches"]} == {"grad"}
    [hint] = rec["hints"]
    assert hint.startswith("Gradients differ (") and "no_sync() without a final synced backward" in hint
    assert "no DistributedDataParallel wrapper" not in hint


def test_zero_master_check_differing_with_parameters_on_its_ranks_blames_an_edit_not_an_optimizer_load() -> None:
    from weightsync_audit.engine.explain import Evidence, explain
    from weightsync_audit.reporting.record import Mismatch

    check = Mismatch("zero.fp32_master_matches_params", "optimizer", [1], [0])
    with_params = explain(Evidence([Mismatch("net.2.bias", "param", [1], [0]), check]))
    assert len(with_params) == 1 and "net.2.bias differ: likely those parameters were edited" in with_params[0]
    assert "loaded or reset" not in with_params[0]  # the optimizer-state rule is not asked for them
    alone = explain(
        Evidence([check, Mismatch("net.0.bias", "param", [2], [0])])
    )  # a parameter off on another rank only
    assert "no parameter differs on those ranks: likely that master partition was changed" in alone[0], alone
    assert any("net.0.bias" in h for h in alone[1:]), alone


def test_explain_takes_the_evidence_whole_and_the_engine_imports_nothing_of_the_ddp_adapter() -> None:
    import ast
    import inspect
    from pathlib import Path

    import weightsync_audit
    from weightsync_audit.engine.explain import Evidence, explain
    from weightsync_audit.reporting.record import Mismatch

    assert list(inspect.signature(explain).parameters) == ["evidence"]
    assert explain(Evidence([])) == []
    ev = Evidence([Mismatch("0.weight", "param", [1], [0])], state_names=["0.weight.exp_avg"])
    assert explain(ev)[0].startswith("Parameters 0.weight differ while the optimizer state stepped")
    assert ev.explained == {"0.weight"}  # the ledger the rules filled
    engine = Path(weightsync_audit.__file__).parent / "engine"
    for path in engine.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            assert not any(n == "weightsync_audit.ddp" or n.startswith("weightsync_audit.ddp.") for n in names), path


def test_an_engine_rule_is_its_generic_rule_asked_under_an_engine_only_in_its_own_words() -> None:
    from weightsync_audit.engine.explain import ENGINE_RULES
    from weightsync_audit.engine.explain.evidence import Evidence
    from weightsync_audit.engine.explain.rules import RULES
    from weightsync_audit.reporting.record import Mismatch

    generic = {rule.cause: rule for rule in RULES}
    mismatches = [Mismatch("fc.weight", "param", [1], [0]), Mismatch("fc.bias", "grad", [1], [0])]
    assert set(ENGINE_RULES) == {"gradients differ", "parameters differ"}
    for cause, variants in ENGINE_RULES.items():
        for variant in variants:
            base = generic[cause]
            assert (variant.ruled_out, variant.accounts, variant.proven) == (base.ruled_out, base.accounts, base.proven)
            assert variant.cause == f"{cause} under a sharding engine"
            assert variant.find(Evidence(mismatches)) is None  # no engine: the generic rule speaks
            under = Evidence(mismatches, engine="DeepSpeed ZeRO-2")
            assert variant.needs(under) == base.needs(under)
            assert "under DeepSpeed ZeRO-2" in variant.says(under, variant.needs(under))
