"""Faults in the middle of a channel round are named at once, by every surviving rank alike.

Real forked gloo ranks (``run_ranks`` fails the test on a hang); every bound is measured on the rank.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ranks import RankDied, run_ranks
from torch import nn

from weightsync_audit import Auditor, AuditTimeoutError
from weightsync_audit.channel.star import DEFAULT_GRACE_S, Comm

DEADLINE_S = 3.0
SLACK_S = 3.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))


def _pids() -> list[int]:
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return pids


def _timed(fn: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        out = fn()
    except AuditTimeoutError as exc:
        return {"missing": exc.missing_ranks, "message": str(exc), "elapsed": time.monotonic() - t0}
    return {"missing": None, "out": out, "elapsed": time.monotonic() - t0}


def _coordinator_dies_deciding(rank: int, world: int) -> dict[str, Any]:
    comm = Comm(timeout_s=None)  # no deadline at all: only the closed connection can tell
    comm.setup()

    def rule(parts: list[bytes]) -> bytes:  # runs on the coordinator only, after every rank's bytes arrived
        os.kill(os.getpid(), signal.SIGKILL)
        return b""

    return _timed(lambda: comm.decide(b"x" * 1000, rule, "a round whose coordinator dies"))


def test_coordinator_killed_mid_round_is_named_at_once_without_a_deadline() -> None:
    results = run_ranks(_coordinator_dies_deciding, 3, timeout=60, may_die=[0])
    assert isinstance(results[0], RankDied)
    for r in results[1:]:
        assert r["missing"] == [0] and r["elapsed"] < SLACK_S, r


def _coordinator_stopped(rank: int, world: int, done: str) -> dict[str, Any]:
    pids = _pids()
    auditor = Auditor(_model(), timeout_s=DEADLINE_S)
    assert auditor.audit(step=0).in_sync
    dist.barrier()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # also stops the job's store, served from this process
    out = _timed(lambda: auditor.audit(step=1))
    if rank == 1:
        os.kill(pids[0], signal.SIGCONT)
    # Rank 0's process hosts the store: the others stay until it has decided (at most 3 s).
    (Path(done) / str(rank)).touch()
    t1 = time.monotonic()
    while time.monotonic() - t1 < 3 and len(list(Path(done).iterdir())) < world:
        time.sleep(0.05)
    return out


def test_stopped_coordinator_hosting_the_store_cannot_hold_the_others_past_the_deadline(tmp_path: Path) -> None:
    results = run_ranks(_coordinator_stopped, 3, str(tmp_path), timeout=60)
    for rank, r in enumerate(results):
        assert r["missing"] == [0], (rank, r)
        if rank:
            assert r["elapsed"] < DEADLINE_S + DEFAULT_GRACE_S + SLACK_S, (rank, r)
    assert "arrived after the others had given up" in results[0]["message"], results[0]


def _peer_dies_before_its_answer(rank: int, world: int) -> list[dict[str, Any]]:
    pids = _pids()
    comm = Comm(timeout_s=DEADLINE_S)

    def rule(parts: list[bytes]) -> bytes:  # the coordinator kills rank 2 after its bytes arrived
        os.kill(pids[2], signal.SIGKILL)
        time.sleep(0.5)
        return b"answer"

    if rank == 2:
        comm.decide(b"2", rule, "the round")
        time.sleep(60)  # killed before here
    first = _timed(lambda: comm.decide(str(rank).encode(), rule, "the round"))
    second = _timed(lambda: comm.decide(b"again", lambda parts: b"", "the next round"))
    return [first, second]


def test_rank_lost_before_its_answer_is_named_alike_by_every_survivor_at_the_next_round() -> None:
    results = run_ranks(_peer_dies_before_its_answer, 3, timeout=60, may_die=[2])
    assert isinstance(results[2], RankDied)
    for rank in (0, 1):
        first, second = results[rank]
        assert first["missing"] is None and first["out"] == b"answer", (rank, first)
        assert second["missing"] == [2] and second["elapsed"] < SLACK_S, (rank, second)


def _coordinator_slow_to_digest(rank: int, world: int) -> dict[str, Any]:
    comm = Comm(timeout_s=0.5, grace_s=0.5)
    comm.setup()
    if rank == 0:  # its receives posted as an audit starts; its own digests then outlast every deadline
        comm.prime()
        time.sleep(3.0)
    out = _timed(lambda: comm.decide(str(rank).encode(), lambda parts: b"in sync", "the audit"))
    dist.barrier()  # rank 0 hosts the store: the others stay until it has decided
    return out


def test_a_coordinator_slower_than_the_deadline_is_named_alike_though_the_summaries_reached_it() -> None:
    """The others' summaries reach the coordinator's receives, posted before its digests, and then the
    others give up on it: it must not call that audit in sync (every rank returns the same record)."""
    results = run_ranks(_coordinator_slow_to_digest, 3, timeout=60)
    for rank, r in enumerate(results):
        assert r["missing"] == [0], (rank, r)
