"""A repair never makes things worse and says what it did (issue 21, items 3, 7, 17): diverged gradients
are resynced and the confirming audit compares them; a resync never copies NaN/inf over a finite copy;
non-finite values are counted on diverged tensors always and everywhere with ``check_finite``."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

from weightsync_audit import AuditOptions, Auditor, AuditResult, ResyncError, WeightDivergenceError, audit, resync
from weightsync_audit.engine.repair.plan import plan_resync
from weightsync_audit.integrations.session.runner import AuditRunner
from weightsync_audit.reporting.record import Mismatch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _gathered(t: torch.Tensor, world: int) -> list[list[float]]:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, t.detach().reshape(-1).tolist())
    return out


# -- 3. gradients resynced, and the confirmation compares them ----------------------------------------


def _grads_resynced(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = AuditRunner(AuditOptions(include=("params", "grads"), on_mismatch="resync", resync_src=0, verbose=False))
    runner.open(world_size=world, is_main=rank == 0)
    torch.manual_seed(rank)  # a different batch per rank and no DDP: the gradients differ
    model(torch.randn(5, 4)).pow(2).mean().backward()
    result = runner.run(model, [opt], step=1, epoch=0, hook="on_before_optimizer_step", is_main=rank == 0, grads=True)
    runner.close()
    assert result is not None
    opt.step()  # the step taken after the resync is the same everywhere
    return {
        "action": result.action,
        "notes": result.notes,
        "kinds": sorted({m.kind for m in result.mismatches}),
        "grads": _gathered(model[0].weight.grad, world),
        "weights": _gathered(model[0].weight, world),
        "after": audit(model, include=("params", "grads")).in_sync,
    }


def test_diverged_gradients_are_resynced_and_the_confirming_audit_compares_them() -> None:
    got = run_ranks(_grads_resynced, 2, timeout=60)
    g = got[0]
    assert g["kinds"] == ["grad"]
    assert g["action"] == "resynced"
    assert g["grads"][0] == g["grads"][1], "the gradients are the source's on every rank"
    assert g["weights"][0] == g["weights"][1], "so the step taken after the resync is the same"
    assert g["after"] is True
    assert any("gradient(s)" in n and "confirmed" in n for n in g["notes"]), g["notes"]


# -- 7. never a non-finite source ------------------------------------------------------------------------


def _nan_on_rank0(rank: int, world: int, mode: str) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        if rank == 0:
            model[1].weight[0, 0] = math.nan  # a tie on 2 ranks: the reference side is rank 0's, the NaN
        elif mode == "both":
            model[1].weight[1, 1] = math.inf
        else:
            model[1].weight.add_(0.5)
    finite = model[1].weight.detach().clone() if rank == 1 else None
    first = audit(model, opt)
    out: dict[str, Any] = {"record": first.to_dict()}
    if mode == "majority":
        resync(model, opt, src="majority")
        out["notes"] = []
    else:
        runner = AuditRunner(AuditOptions(on_mismatch="resync", resync_src=0, verbose=False))
        runner.open(world_size=world, is_main=rank == 0)
        try:
            result = runner.run(model, [opt], step=3, epoch=0, hook="on_train_batch_end", is_main=rank == 0)
            out["action"], out["notes"] = result.action if result else None, result.notes if result else []
        except WeightDivergenceError as exc:  # the answer when no source is finite
            out["action"], out["notes"] = type(exc).__name__, [str(exc), *exc.result.notes]
        runner.close()
    out["weight"] = _gathered(model[1].weight, world)
    out["finite"] = None if finite is None else finite.reshape(-1).tolist()
    return out


@pytest.mark.parametrize("mode", ["callback", "majority"])
def test_a_tie_is_never_resynced_from_the_side_holding_nan(mode: str) -> None:
    got = run_ranks(_nan_on_rank0, 2, mode, timeout=60)
    r0 = got[0]
    (m,) = r0["record"]["mismatches"]
    assert m["nonfinite"] == {"0": 1}
    assert "NaN or inf in the reference copy (rank 0" in m["detail"] and "rank 1 holds finite values" in m["detail"]
    assert "holds another value" not in m["detail"]
    assert r0["weight"][0] == r0["weight"][1] == got[1]["finite"], "both ranks hold rank 1's finite values"
    if mode == "callback":
        assert r0["action"] == "resynced"
        assert any("rank 0 holds NaN/inf in 1.weight where rank 1 holds finite" in n for n in r0["notes"]), r0
    AuditResult.from_dict(json.loads(json.dumps(r0["record"])))  # the new field validates


def test_no_finite_copy_means_no_resync_and_an_error_naming_the_tensor() -> None:
    got = run_ranks(_nan_on_rank0, 2, "both", timeout=60)
    for r in got:
        assert r["action"] == "WeightDivergenceError"
        assert any("resync impossible" in n and "1.weight" in n and "NaN or inf" in n for n in r["notes"]), r
    # Nothing moved: each rank kept its own copy (rank 0 its NaN, rank 1 its inf).
    assert math.isnan(got[0]["weight"][0][0]) and math.isinf(got[1]["weight"][1][4])


def test_plan_takes_the_finite_side_of_a_tie_and_refuses_when_none_is_finite() -> None:
    tie = "tie vote: rank 0 vs rank 1, no majority"
    nan_ref = Mismatch("w", "param", [1], [0], detail=tie, nonfinite={0: 3})
    assert plan_resync([nan_ref], 0).sources == {1: ["w"]}
    assert plan_resync([nan_ref], "majority").sources == {1: ["w"]}
    nan_odd = Mismatch("w", "param", [1], [0], detail=tie, nonfinite={1: 3})
    assert plan_resync([nan_odd], 1).sources == {0: ["w"]}  # even the user's chosen source, when it holds NaN
    majority_nan = Mismatch("w", "param", [2], [0, 1], nonfinite={0: 1, 1: 1})
    assert plan_resync([majority_nan], "majority").sources == {2: ["w"]}
    grad = Mismatch("w", "grad", [1], [0], detail=tie, nonfinite={0: 1})
    assert plan_resync([grad], 0).grads == {1: ["w"]}
    with pytest.raises(ResyncError, match="param w.*NaN or inf"):
        plan_resync([Mismatch("w", "param", [1], [0], detail=tie, nonfinite={0: 1, 1: 2})], 0)


# -- 17. non-finite values said plainly ------------------------------------------------------------------


def _all_nan(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan)
        model[1].bias.fill_(1.0)
    plain = audit(model)
    auditor = Auditor(model, check_finite=True)
    checked = [auditor.audit(), auditor.audit()]  # the first audit and the cached path
    return {"plain": plain.to_dict(), "checked": [r.to_dict() for r in checked]}


def test_a_model_full_of_nan_on_every_rank_is_never_a_silent_in_sync_with_check_finite() -> None:
    got = run_ranks(_all_nan, 2, timeout=60)
    strip = [[{k: v for k, v in r.items() if k not in ("time", "duration_ms")} for r in g["checked"]] for g in got]
    assert strip[0] == strip[1], "the same record on every rank"
    plain = got[0]["plain"]
    assert plain["in_sync"] and "nonfinite_count" not in plain  # not counted without the option
    for rec in got[0]["checked"]:
        assert rec["in_sync"] and rec["nonfinite_count"] == 3
        assert any(n.startswith("in sync, but 3 tensor(s) hold NaN/inf") for n in rec["notes"]), rec["notes"]
        assert "0.weight" in " ".join(rec["notes"])
        AuditResult.from_dict(rec)


def test_check_finite_counts_nothing_on_a_finite_model() -> None:
    r = audit(_model(), check_finite=True)
    assert r.in_sync and r.nonfinite_count == 0 and not r.notes


def test_check_finite_finds_nan_in_place_large_and_in_python_values_on_the_cached_path() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(300, 300))  # a small (in place) and a large weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    auditor = Auditor(model, opt, check_finite=True)
    assert [auditor.audit().nonfinite_count for _ in range(3)] == [0, 0, 0]
    with torch.no_grad():
        model[0].weight[1, 2] = math.inf
        model[1].weight[7, 7] = math.nan
    opt.param_groups[0]["lr"] = math.nan
    r = auditor.audit()
    assert r.in_sync and r.nonfinite_count == 3
    assert all(n in r.notes[-1] for n in ("0.weight", "1.weight", "param_groups.0.lr")), r.notes


def test_nonfinite_counts_are_exact_when_a_sum_overflows() -> None:
    from weightsync_audit.engine.measure.finite import count_nonfinite, screen_nonfinite

    big = torch.full((40_000,), 60_000.0, dtype=torch.float16)  # every element finite, the sum is not
    small = torch.full((8,), 60_000.0, dtype=torch.float16)
    assert count_nonfinite(big) == 0
    assert screen_nonfinite([big, small, small, torch.ones(3), torch.tensor([1.0, -math.inf])])[0] == [4]
    assert count_nonfinite(torch.tensor([math.nan, 1.0, math.inf, -math.inf])) == 3
    assert count_nonfinite(torch.arange(5)) == 0
