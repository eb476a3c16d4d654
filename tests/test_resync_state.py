"""A resync right after an audit reads what that audit prepared (its channel, its manifest under the replica
rules) instead of building them again, with the same result, bit for bit, as the standalone ``resync``; and the
phases of an audit hand each other frozen results."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

from weightsync_audit import Auditor, resync
from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.context import AuditContext, Explained, Localized, Measured, Prepared, SharedHints, Tally
from weightsync_audit.engine.overlap import OverlapRun
from weightsync_audit.engine.repair import plan as state_module
from weightsync_audit.engine.repair.plan import Holding, plan_copies, plan_resync
from weightsync_audit.engine.repair.resync import resync_planned
from weightsync_audit.engine.run import AuditRun


def _pair(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    if rank == 1:  # a parameter and its optimizer state drift on one rank
        with torch.no_grad():
            model[0].weight[0, 0] += 1.0
        opt.state[model[2].bias]["exp_avg"][0] += 0.5
    return model, opt


def _bytes(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    out: list[Any] = [t.detach().clone() for t in model.state_dict().values()]
    for state in opt.state.values():
        out += [v.detach().clone() if isinstance(v, torch.Tensor) else v for _, v in sorted(state.items())]
    return out


def _after_an_audit(rank: int, world: int) -> dict[str, Any]:
    model, opt = _pair(rank)
    twin, twin_opt = copy.deepcopy((model, opt))  # the same replica, to resync the standalone way
    auditor = Auditor(model, opt, timeout_s=30, exclude=("1.*",))  # buffers left out of the audit
    result = auditor.audit(step=1)
    state = auditor.resync_state(result)
    builds: list[int] = []
    real = state_module.replica_manifest
    state_module.replica_manifest = lambda *a, **k: builds.append(1) or real(*a, **k)  # type: ignore[assignment]
    try:
        plan = plan_resync(result.mismatches, 0)
        resync_planned(state, plan)  # the audit's channel and manifest
        reads_audit = len(builds)
        fresh = auditor.resync_state(result, model, opt)  # the same result, asked again: still the audit's
        other = auditor.resync_state(copy.copy(result))  # another record: built when read
        other.entries({"1.running_mean"})
        builds_for_other = len(builds) - reads_audit
    finally:
        state_module.replica_manifest = real  # type: ignore[assignment]
    names = sorted(m.name for m in result.mismatches)
    resync(twin, twin_opt, src=0, names=names, timeout_s=30)  # the standalone path, on the twin
    same = all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for a, b in zip(_bytes(model, opt), _bytes(twin, twin_opt))
    )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, [t.tolist() if isinstance(t, torch.Tensor) else t for t in _bytes(model, opt)])
    return {
        "names": names,
        "same_comm": state.comm is auditor.comm,
        "audited": state.audited is not None and state.diverged == frozenset(names),
        "builds_reading_the_audit": reads_audit,
        "kept": fresh is state,
        "other_audited": other.audited is None,
        "builds_for_other": builds_for_other,
        "same_as_standalone": same,
        "replicas_equal": gathered[0] == gathered[1],
        "in_sync_after": auditor.audit(step=2).in_sync,
    }


def test_a_resync_after_an_audit_reads_its_state_and_matches_the_standalone_resync_bit_for_bit() -> None:
    for r in run_ranks(_after_an_audit, 2, timeout=90):
        assert r["names"] == ["0.weight", "2.bias.exp_avg"], r
        assert r["same_comm"] and r["audited"] and r["kept"], r
        assert r["builds_reading_the_audit"] == 0, r  # nothing built twice
        assert r["other_audited"] and r["builds_for_other"] == 1, r  # another record: its own manifest
        assert r["same_as_standalone"] and r["replicas_equal"] and r["in_sync_after"], r


def test_an_audit_in_sync_keeps_nothing_and_the_state_names_its_channel_and_model() -> None:
    model = nn.Linear(2, 2)
    auditor = Auditor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result = auditor.audit(step=0)
    assert result.in_sync and auditor.resync_state(result).audited is None  # in sync: nothing kept
    state = auditor.resync_state(result)
    assert (
        state.comm is auditor.comm
        and state.module is model
        and [e.name for e in state.entries(None)][:2]
        == [
            "weight",
            "bias",
        ]
    )


@pytest.mark.parametrize("cls", [Prepared, Localized, Tally, SharedHints,
                                 Measured, Explained, AuditRun, AuditContext])  # fmt: skip
def test_every_phase_result_and_the_run_itself_is_frozen(cls: type) -> None:
    params = getattr(cls, "__dataclass_params__", None)
    assert params is not None and params.frozen, cls
    assert "__slots__" in vars(cls) and cls.__dictoffset__ == 0, cls  # no instance dict: nothing added later


def test_the_run_holds_its_inputs_only() -> None:
    # One context, built by one function, is everything a run reads (a synchronous and an overlapped one alike).
    assert [f.name for f in dataclasses.fields(AuditRun)] == ["context", "t0"]
    assert [f.name for f in dataclasses.fields(OverlapRun)] == ["context", "t0", "guard"]
    model = nn.Linear(2, 2)
    run = AuditRun(Auditor(model).context(model, [], step=0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.context = run.context  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.context.step = 1  # type: ignore[misc]
    result, manifest = run.phases()
    assert result.in_sync and manifest.size == 2


def _two_sources(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        if rank == 0:
            model[2].bias.add_(1.0)  # resync_src=0 holds a minority value: taken from rank 1
        if rank == 2:
            model[0].weight.add_(1.0)  # taken from rank 0
    auditor = Auditor(model, opt, timeout_s=30)
    result = auditor.audit(step=1)
    plan = plan_resync(result.mismatches, 0)
    rounds: list[str] = []
    real = Comm._round

    def counted(self: Comm, payload: Any, rule: Any, what: str, *args: Any) -> Any:
        rounds.append(what)  # the channel's own round runs as ever: only counted here
        return real(self, payload, rule, what, *args)

    Comm._round = counted  # type: ignore[method-assign]
    try:
        resync_planned(auditor.resync_state(result), plan)
    finally:
        Comm._round = real  # type: ignore[method-assign]
    return {"sources": plan.sources, "rounds": rounds, "after": auditor.audit(step=2).in_sync}


def test_a_plan_with_two_sources_is_decided_in_one_round_and_moved_in_one_transfer() -> None:
    for r in run_ranks(_two_sources, 3, timeout=90):
        assert r["sources"] == {0: ["0.weight"], 1: ["2.bias"]}, r
        assert r["rounds"] == ["the resync plan", "the resync result"], r  # not one round trip per source
        assert r["after"], r


def test_a_copy_is_planned_over_typed_rows_plain_held_and_sharded_alike() -> None:
    plain = [Holding("param", "w", "float32", (2,), d) for d in (5, 6, 5, 5)]
    held = [
        Holding("param", "e", "float32", (2,), d, "holders:expert", k, ()) for d, k in ((1, 7), (1, 9), (2, 7), (3, 9))
    ]
    shard = [Holding("param", "s", "float32", (1,), d, "shard", k) for d, k in ((4, 2), (4, 3), (5, 2), (4, 3))]
    lr = [
        Holding("optimizer", "param_groups.0.lr", "float64", (), d, literal=t)
        for d, t in ((1, "0.1"),) * 3 + ((2, "0.5"),)
    ]
    plan = plan_copies([list(row) for row in zip(plain, held, shard, lr)], src=0)
    # Each within its group: w among all ranks, e among {0, 2} and {1, 3} (a tie: the lower rank), s among its peers.
    assert plan["copies"] == [["param:w", 0, [1], "float32", [2]], ["param:e", 0, [2], "float32", [2]],
                              ["param:e", 1, [3], "float32", [2]], ["param:s", 0, [2], "float32", [1]]], plan  # fmt: skip
    assert plan["values"] == [["optimizer:param_groups.0.lr", 0, [3], "0.1"]] and not plan["refused"], plan
    assert plan["install"] is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain[0].digest = 1  # type: ignore[misc]
    missing = plan_copies([[plain[0]], []], src=0)
    assert missing["refused"] == ["param:w missing on rank 1"] and not missing["copies"], missing
