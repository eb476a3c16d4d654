"""Ranks that audit at different points get one clear error on every rank: never a hang, never a false
divergence, and the message says which rank is where."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from ranks import run_ranks
from torch import nn

from weightsync_audit import Auditor, AuditOutOfStepError, AuditTimeoutError, audit, resync


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def _outcome(fn: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        r = fn()
    except (AuditOutOfStepError, AuditTimeoutError) as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "positions": getattr(exc, "positions", None),
            "elapsed": time.monotonic() - t0,
        }
    return {"error": None, "in_sync": r.in_sync if r is not None else None}


def _different(rank: int, world: int, what: str) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs: dict[str, Any] = {"step": 10, "hook": "on_train_batch_end"}
    include: tuple[str, ...] = ("params", "buffers", "optimizer")
    if rank == 1:
        if what == "step":
            kwargs["step"] = 11
        elif what == "hook":
            kwargs["hook"] = "on_validation_start"
        elif what == "include":
            include = ("params",)
        elif what == "epoch":
            kwargs["epoch"] = 3
    if rank == 1 and what == "weights_and_step":
        kwargs["step"] = 11
        with torch.no_grad():
            model[0].weight.add_(1.0)
    auditor = Auditor(model, opt, include=include, timeout_s=20)
    return _outcome(lambda: auditor.audit(**kwargs))


@pytest.mark.parametrize(
    "what,rank1_says",
    [
        ("step", "rank 1: step 11"),
        ("epoch", "rank 1: step 10, epoch 3"),
        ("hook", "rank 1: step 10, epoch None, hook on_validation_start"),
        ("include", "rank 1: step 10, epoch None, hook on_train_batch_end, include=params "),
        ("weights_and_step", "rank 1: step 11"),
    ],
)
def test_ranks_auditing_at_different_points_raise_out_of_step_on_every_rank_saying_who_is_where(
    what: str, rank1_says: str
) -> None:
    results = run_ranks(_different, 3, what, timeout=60)
    for rank, r in enumerate(results):
        # An error on every rank, never a false divergence (no result), never a timeout.
        assert r["error"] == "AuditOutOfStepError", (rank, r)
        assert rank1_says in r["message"], r["message"]
        assert "rank 0: step 10" in r["message"] and "rank 2: step 10" in r["message"]
        assert set(r["positions"]) == {0, 1, 2}
    assert results[0]["message"] == results[1]["message"] == results[2]["message"]


def _audit_vs_resync(rank: int, world: int) -> list[dict[str, Any]]:
    model = _model()
    if rank == 1:
        first = _outcome(lambda: resync(model, timeout_s=20))
    else:
        first = _outcome(lambda: audit(model, step=1, timeout_s=20))
    # The channel's message streams are now out of step for good: the next audit says so at once.
    second = _outcome(lambda: audit(model, step=2, timeout_s=20))
    return [first, second]


def test_one_rank_resyncing_while_the_others_audit_is_out_of_step_not_a_crash() -> None:
    results = run_ranks(_audit_vs_resync, 3, timeout=60)
    for rank, (first, second) in enumerate(results):
        assert first["error"] == "AuditOutOfStepError", (rank, first)
        assert "rank 1: at the resync" in first["message"], first["message"]
        assert "rank 0: at the audit summary" in first["message"], first["message"]
        assert first["elapsed"] < 5
        assert second["error"] == "AuditOutOfStepError" and second["elapsed"] < 0.5, (rank, second)


def _extra_audit(rank: int, world: int) -> list[dict[str, Any]]:
    auditor = Auditor(_model(), timeout_s=2)
    out = [_outcome(lambda: auditor.audit(step=0))]
    if rank == 0:  # rank 0 audits once more than the others, then all audit step 1
        out.append(_outcome(lambda: auditor.audit(step=0)))
    out.append(_outcome(lambda: auditor.audit(step=1)))
    return out


def test_a_rank_that_audits_once_more_than_the_others_gets_an_error_naming_both_steps() -> None:
    r0, r1 = run_ranks(_extra_audit, 2, timeout=60)
    assert r0[0]["in_sync"] and r1[0]["in_sync"]
    # rank 0's extra audit (step 0) meets rank 1's next one (step 1): out of step, on both ranks.
    assert r0[1]["error"] == r1[1]["error"] == "AuditOutOfStepError"
    assert "rank 0: step 0" in r0[1]["message"] and "rank 1: step 1" in r0[1]["message"]
    # rank 0's step-1 audit then finds nobody: a timeout naming rank 1, within its deadline.
    assert r0[2]["error"] == "AuditTimeoutError" and "[1]" in r0[2]["message"], r0[2]
    assert r0[2]["elapsed"] < 2 + 3


def _different_coverage(rank: int, world: int) -> dict[str, Any]:
    auditor = Auditor(_model(), coverage=1 if rank == 0 else "1/4", timeout_s=20)
    return _outcome(lambda: auditor.audit(step=0))


def test_different_coverage_settings_are_out_of_step() -> None:
    for r in run_ranks(_different_coverage, 2, timeout=60):
        assert r["error"] == "AuditOutOfStepError" and "coverage=1/4" in r["message"], r
