"""The channel as a tree (per host, then across hosts): the same verdicts and failures as the star.

Real forked gloo ranks: 4 ranks forced into 2 "hosts" of 2 (``WEIGHTSYNC_AUDIT_RANKS_PER_HOST=2``, read by
the coordinator when the channel opens): ranks 0 and 2 lead, 1 and 3 report to them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import RankDied, collect_ranks, run_ranks, start_ranks
from torch import nn

from weightsync_audit import Auditor, AuditOutOfStepError, AuditPreparationError, AuditTimeoutError, audit
from weightsync_audit.channel.star import DEFAULT_GRACE_S, RANKS_PER_HOST_ENV, Comm

DEADLINE_S = 3.0
SLACK_S = 3.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))


def _audits(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    auditor = Auditor(model, opt, timeout_s=30)
    healthy = auditor.audit(step=0)
    sent = auditor.comm._group.sent_messages
    auditor.audit(step=1)
    sent = auditor.comm._group.sent_messages - sent
    if rank == 3:
        with torch.no_grad():
            model[1].bias[0] += 1
    diverged = auditor.audit(step=2)
    mismatches = [(m.name, m.kind, m.ranks, m.reference_ranks, m.max_abs_diff) for m in diverged.mismatches]
    return {
        "block": auditor.comm._group.block,
        "sent": sent,
        "healthy": (healthy.in_sync, dict(healthy.checked)),
        "diverged": (diverged.in_sync, mismatches),
    }


def test_audits_through_the_tree_give_the_star_s_verdicts_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    star = run_ranks(_audits, 4)
    monkeypatch.setenv(RANKS_PER_HOST_ENV, "2")
    tree = run_ranks(_audits, 4)
    assert [r["block"] for r in star] == [0] * 4 and [r["block"] for r in tree] == [2] * 4
    # A healthy audit is one round: the coordinator answers its local and the other leader; that leader
    # asks the coordinator and answers its local; a local asks its leader.
    assert [r["sent"] for r in star] == [3, 1, 1, 1] and [r["sent"] for r in tree] == [2, 1, 2, 1]
    first = tree[0]
    assert first["healthy"][0] and first["diverged"][0] is False
    assert [m[2] for m in first["diverged"][1]] == [[3]]
    for r in tree + star:
        assert (r["healthy"], r["diverged"]) == (first["healthy"], first["diverged"])


def _late(rank: int, world: int, late: int, done: str) -> dict[str, Any]:
    comm = Comm(timeout_s=DEADLINE_S)
    comm.setup()
    t0 = time.monotonic()
    if rank == late:
        time.sleep(DEADLINE_S + DEFAULT_GRACE_S / 2 + 1)  # past the coordinator's wait for a leader
    t1 = time.monotonic()
    try:
        comm.decide(bytes([rank]), lambda parts: b"".join(parts), "the round")
        out: dict[str, Any] = {"missing": None}
    except AuditTimeoutError as exc:
        out = {"missing": exc.missing_ranks, "message": str(exc), "elapsed": time.monotonic() - t1}
    out["block"] = comm._group.block
    (Path(done) / str(rank)).touch()  # stay until every rank is done: rank 0's process hosts the store
    while time.monotonic() - t0 < 3 * DEADLINE_S + 2 * DEFAULT_GRACE_S and len(list(Path(done).iterdir())) < world:
        time.sleep(0.05)
    return out


LATE = {"coordinator-s-local": 1, "leader-s-local": 3, "leader-with-its-host": 2}
"""Which rank never comes, by case."""


@pytest.fixture(scope="module")
def late_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """The :data:`LATE` cases' jobs side by side (each its own 4 ranks, port and store): they mostly wait."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(RANKS_PER_HOST_ENV, "2")
        started = {case: start_ranks(_late, 4, late, str(tmp_path_factory.mktemp(case))) for case, late in LATE.items()}
    return {case: collect_ranks(job, timeout=90) for case, job in started.items()}


@pytest.mark.parametrize("case,named", [(c, n) for c, n in zip(LATE, ([1], [3], [2, 3]))], ids=list(LATE))
def test_a_rank_that_never_comes_is_named_alike_by_every_rank_within_the_deadline(
    case: str, named: list[int], late_runs: dict[str, list[Any]]
) -> None:
    late, results = LATE[case], late_runs[case]
    for rank, r in enumerate(results):
        assert r["block"] == 2 and r["missing"] == named, (rank, r)
        if rank != late:
            assert r["elapsed"] < DEADLINE_S + DEFAULT_GRACE_S + SLACK_S, (rank, r)
        else:
            assert "arrived after the others had given up" in r["message"], (rank, r)


def _out_of_step(rank: int, world: int) -> Any:
    comm = Comm(timeout_s=30)
    comm.setup()
    try:
        comm.decide(b"x", lambda parts: b"", "the other round" if rank == 3 else "the round")
    except AuditOutOfStepError as exc:
        return comm._group.block, exc.positions
    return None


def test_a_rank_at_another_round_is_out_of_step_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RANKS_PER_HOST_ENV, "2")
    results = run_ranks(_out_of_step, 4)
    assert results[0][0] == 2 and set(results[0][1]) == {0, 3}
    assert "the other round" in results[0][1][3]
    assert all(r == results[0] for r in results)


def _one_shot(rank: int, world: int) -> Any:
    model = _model()
    if rank == 1:
        with torch.no_grad():
            model[0].weight[2, 2] += 1
    result = audit(model, timeout_s=30)
    comm = Comm()
    comm.setup()  # the audit group that audit() opened, shared
    return comm._group.block, result.in_sync, [(m.name, m.ranks) for m in result.mismatches]


def test_a_one_shot_audit_through_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RANKS_PER_HOST_ENV, "2")
    results = run_ranks(_one_shot, 4)
    assert results[0] == (2, False, [("0.weight", [1])])
    assert all(r == results[0] for r in results)


def _bad_option(rank: int, world: int) -> str:
    try:
        Comm(timeout_s=30).setup()
    except AuditPreparationError as exc:
        return str(exc)
    return ""


def test_a_bad_ranks_per_host_is_named_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RANKS_PER_HOST_ENV, "two")
    results = run_ranks(_bad_option, 2)
    assert all(f"{RANKS_PER_HOST_ENV}='two'" in r for r in results), results


def _killed(rank: int, world: int, victim: int) -> dict[str, Any]:
    comm = Comm(timeout_s=None)  # no deadline: only closed connections can tell
    comm.setup()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        comm.decide(bytes([rank]), lambda parts: b"".join(parts), "the round")
    except AuditTimeoutError as exc:
        return {"missing": exc.missing_ranks, "elapsed": time.monotonic() - t0}
    return {"missing": None}


@pytest.mark.parametrize("victim,named", [(3, [3]), (2, [2, 3])], ids=["local", "leader-with-its-host"])
def test_a_killed_rank_is_named_alike_at_once_without_a_deadline(
    victim: int, named: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RANKS_PER_HOST_ENV, "2")
    results = run_ranks(_killed, 4, victim, timeout=60, may_die=[victim])
    assert isinstance(results[victim], RankDied)
    for rank in {0, 1, 2, 3} - {victim}:
        assert results[rank]["missing"] == named and results[rank]["elapsed"] < SLACK_S, (rank, results[rank])


def _local_dies_before_its_answer(rank: int, world: int) -> list[Any]:
    pids: list[Any] = [None] * world
    torch.distributed.all_gather_object(pids, os.getpid())
    comm = Comm(timeout_s=DEADLINE_S)
    comm.setup()

    def rule(parts: list[bytes]) -> bytes:  # the coordinator kills rank 3 after its bytes reached it
        os.kill(pids[3], signal.SIGKILL)
        time.sleep(0.5)
        return b"answer"

    out: list[Any] = [comm.decide(str(rank).encode(), rule, "the round")]
    if rank == 3:
        time.sleep(60)  # killed before here
    try:
        comm.decide(b"again", lambda parts: b"", "the next round")
    except AuditTimeoutError as exc:
        out.append(exc.missing_ranks)
    return out


def test_a_local_lost_before_its_answer_is_named_alike_at_the_next_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RANKS_PER_HOST_ENV, "2")
    results = run_ranks(_local_dies_before_its_answer, 4, timeout=60, may_die=[3])
    assert isinstance(results[3], RankDied)
    assert [results[r] for r in (0, 1, 2)] == [[b"answer", [3]]] * 3
