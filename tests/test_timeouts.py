"""A rank that is late, stuck or killed never hangs the others: they raise AuditTimeoutError naming it.

Real forked gloo ranks; every bound below is measured on the rank itself, and ``run_ranks`` fails the
test if any rank hangs.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import RankDied, collect_ranks, run_ranks, start_ranks
from torch import nn

from weightsync_audit import Auditor, AuditTimeoutError, audit
from weightsync_audit.channel.star import DEFAULT_GRACE_S

DEADLINE_S = 3.0
SLACK_S = 3.0
"""'Within the deadline plus a few seconds': the bound every waiting rank must meet."""


def _stay_until_all_done(done: str, rank: int, world: int, t0: float, cap_s: float) -> None:
    """Mark this rank done, then stay alive until every rank is (rank 0's process hosts the job's store),
    at most until ``cap_s`` after ``t0``."""
    (Path(done) / str(rank)).touch()
    while time.monotonic() - t0 < cap_s and len(list(Path(done).iterdir())) < world:
        time.sleep(0.05)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))


def _timed_audit(auditor: Auditor, step: int) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        auditor.audit(step=step)
    except AuditTimeoutError as exc:
        return {"error": "timeout", "missing": exc.missing_ranks, "message": str(exc), "elapsed": time.monotonic() - t0}
    return {"error": None, "elapsed": time.monotonic() - t0}


def _late_rank(rank: int, world: int, late: int, first_audit: bool, done: str) -> list[dict[str, Any]]:
    auditor = Auditor(_model(), timeout_s=DEADLINE_S)
    if not first_audit:
        assert auditor.audit(step=0).in_sync  # the audit channel is open and healthy
    t0 = time.monotonic()
    if rank == late:
        time.sleep(DEADLINE_S + 3)
    out = [_timed_audit(auditor, 1)]
    # Later audits in this process fail at once instead of waiting on a broken channel.
    out.append(_timed_audit(auditor, 2))
    # Stay alive until the late rank has heard the verdict (rank 0's process hosts the job's store).
    _stay_until_all_done(done, rank, world, t0, 2 * DEADLINE_S + 5)
    return out


@pytest.fixture(scope="module")
def sleepers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """The jobs whose rank sleeps past the deadline (rank 2 at a later or its first audit, the coordinator),
    side by side (each its own 3 ranks, port and store): they wait on the deadline."""
    started = {
        "later-audit": start_ranks(_late_rank, 3, 2, False, str(tmp_path_factory.mktemp("later"))),
        "first-audit": start_ranks(_late_rank, 3, 2, True, str(tmp_path_factory.mktemp("first"))),
        "coordinator": start_ranks(_late_coordinator, 3, str(tmp_path_factory.mktemp("coordinator"))),
    }
    return {case: collect_ranks(job, timeout=60) for case, job in started.items()}


@pytest.mark.parametrize("case", ["later-audit", "first-audit"])
def test_rank_sleeping_past_the_deadline_is_named_by_every_rank_within_the_deadline(
    case: str, sleepers: dict[str, list[Any]]
) -> None:
    late, results = 2, sleepers[case]
    for rank, (first, second) in enumerate(results):
        assert first["error"] == "timeout", (rank, first)
        assert first["missing"] == [late], (rank, first)
        assert second["error"] == "timeout" and second["elapsed"] < 0.5, (rank, second)
        if rank != late:
            assert first["elapsed"] < DEADLINE_S + SLACK_S, (rank, first)
            assert "rank(s) [2] did not arrive" in first["message"]
        else:
            # The late rank learns at once, when it finally arrives, that it was the one missing.
            assert first["elapsed"] < SLACK_S, first
            assert "this rank arrived after the others had given up" in first["message"], first


def _late_coordinator(rank: int, world: int, done: str) -> dict[str, Any]:
    auditor = Auditor(_model(), timeout_s=DEADLINE_S)
    assert auditor.audit(step=0).in_sync
    t0 = time.monotonic()
    if rank == 0:
        time.sleep(DEADLINE_S + DEFAULT_GRACE_S + 2)
    out = _timed_audit(auditor, 1)
    _stay_until_all_done(done, rank, world, t0, DEADLINE_S + DEFAULT_GRACE_S + 4)
    return out


def test_coordinator_sleeping_past_the_deadline_is_named_as_rank_0(sleepers: dict[str, list[Any]]) -> None:
    for rank, r in enumerate(sleepers["coordinator"]):
        assert r["error"] == "timeout" and r["missing"] == [0], (rank, r)
        if rank:
            # Non-coordinators also allow the coordinator its own wait for a late rank (the grace).
            assert r["elapsed"] < DEADLINE_S + DEFAULT_GRACE_S + SLACK_S, (rank, r)
            assert "the coordinator (rank 0) did not answer in time" in r["message"]
        else:
            assert r["elapsed"] < SLACK_S and "arrived after the others had given up" in r["message"], r


def _killed_mid_audit(rank: int, world: int, victim: int) -> dict[str, Any]:
    auditor = Auditor(_model(), timeout_s=DEADLINE_S)
    assert auditor.audit(step=0).in_sync
    if rank == victim:
        # Die inside audit(): this rank is slowed down by a model with many tensors, the others are
        # already waiting for its summary when SIGKILL lands.
        big = nn.Module()
        for i in range(100_000):
            big.register_buffer(f"b{i}", torch.zeros(1))
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        auditor.audit(big, step=1)
        time.sleep(60)  # not reached
    return _timed_audit(auditor, 1)


@pytest.mark.parametrize("victim", [2, 0], ids=["worker", "coordinator"])
def test_rank_killed_with_sigkill_mid_audit_is_named_by_the_survivors(victim: int) -> None:
    world = 3
    results = run_ranks(_killed_mid_audit, world, victim, timeout=60, may_die=[victim])
    assert isinstance(results[victim], RankDied)
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        assert r["error"] == "timeout" and r["missing"] == [victim], (rank, r)
        # A dead peer closes its connections: no need to wait for the deadline at all.
        assert r["elapsed"] < DEADLINE_S + SLACK_S, (rank, r)


def _killed_before_first_audit(rank: int, world: int) -> dict[str, Any]:
    dist.barrier()  # the job is fully up; then rank 1 dies before its first audit
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        audit(_model(), timeout_s=DEADLINE_S)
    except AuditTimeoutError as exc:
        return {"missing": exc.missing_ranks, "elapsed": time.monotonic() - t0}
    return {"missing": None}


def test_rank_that_never_reaches_its_first_audit_is_named() -> None:
    results = run_ranks(_killed_before_first_audit, 3, timeout=60, may_die=[1])
    for rank in (0, 2):
        assert results[rank]["missing"] == [1], results
        assert results[rank]["elapsed"] < DEADLINE_S + SLACK_S, results


def _no_timeout_given_but_peer_dies(rank: int, world: int) -> dict[str, Any]:
    auditor = Auditor(_model())  # no timeout_s: the 30-minute default deadline
    assert auditor.audit(step=0).in_sync
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _timed_audit(auditor, 1)


def test_dead_peer_is_reported_at_once_even_without_timeout_s() -> None:
    results = run_ranks(_no_timeout_given_but_peer_dies, 2, timeout=60, may_die=[1])
    assert results[0]["error"] == "timeout" and results[0]["missing"] == [1]
    assert results[0]["elapsed"] < SLACK_S, results[0]


def _healthy_with_deadline(rank: int, world: int) -> list[bool]:
    auditor = Auditor(_model(), timeout_s=0.5)
    out = []
    for step in range(20):
        if rank == step % world:
            time.sleep(0.05)  # ranks arrive a little apart, within the deadline
        out.append(auditor.audit(step=step).in_sync)
    return out


def test_ranks_arriving_apart_within_the_deadline_are_not_a_timeout() -> None:
    for verdicts in run_ranks(_healthy_with_deadline, 4, timeout=60):
        assert all(verdicts)


def test_a_timeout_error_is_a_runtime_error_with_missing_ranks() -> None:
    exc = AuditTimeoutError("x", [3])
    assert isinstance(exc, RuntimeError) and exc.missing_ranks == [3]
