"""The channel's rounds: decided once by the coordinator, the same answer on every rank, bytes bounded.

Real forked gloo ranks. Byte counts are the protocol's sizes (deterministic), not timings.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from ranks import RankFailed, run_ranks

from weightsync_audit import Auditor, AuditPreparationError
from weightsync_audit.engine.agreement.rounds import compare_columns


def _healthy_bytes(rank: int, world: int) -> int:
    torch.manual_seed(0)
    auditor = Auditor(torch.nn.Linear(4, 4))
    assert auditor.audit(step=0).in_sync
    before = auditor.comm.sent_bytes
    assert auditor.audit(step=1).in_sync
    return auditor.comm.sent_bytes - before


def test_healthy_audit_sends_a_fixed_size_per_rank_whatever_the_world() -> None:
    sent = run_ranks(_healthy_bytes, 4)
    assert sent[0] == 3 * 72  # one verdict per peer: a 32-byte header and the 37-byte answer, in words
    # one request frame each: an 80-byte header, the 72-byte summary and its 32-byte bucket sketch
    assert sent[1:] == [184, 184, 184]


def _one_message_each_way(rank: int, world: int) -> tuple[int, int, bytes]:
    from weightsync_audit.channel.star import Comm

    comm = Comm(timeout_s=30)
    comm.setup()
    group = comm._group  # the channel's own message count
    before = group.sent_messages
    answer = comm.decide(bytes([rank]) * 900, lambda parts: b"".join(p[:1] for p in parts) * 200, "a kilobyte")
    return group.sent_messages - before, len(answer), answer[:4]


def test_an_exchange_under_a_kilobyte_each_way_is_one_message_up_and_one_down() -> None:
    results = run_ranks(_one_message_each_way, 3)
    assert [r[0] for r in results] == [2, 1, 1]  # the coordinator answers each peer once, each peer asks once
    assert {(r[1], r[2]) for r in results} == {(600, bytes([0, 1, 2, 0]))}


def _columns(rank: int, world: int) -> list[Any]:
    from weightsync_audit.channel.star import Comm

    comm = Comm(timeout_s=30)
    digests = np.arange(10, dtype=np.int64)
    if rank in (1, 3):
        digests[5] = -1
    if rank == 2:
        digests[7] = -2
        digests[5] = -3
    diffs = compare_columns(comm, [f"t{i}" for i in range(10)], digests)
    out: list[Any] = [(d.uid, d.reference_ranks, d.ranks) for d in diffs]
    out.append(comm.share_bytes(2, b"from two" if rank == 2 else None, "the share"))
    try:
        comm.decide(b"", lambda parts: (_ for _ in ()).throw(ValueError("bad rule")), "a failing rule")
    except AuditPreparationError as exc:
        out.append(str(exc))
    out.append(comm.decide(str(rank).encode(), lambda parts: b"".join(parts), "after the failure"))
    return out


def test_differing_columns_rule_failures_and_shares_come_back_alike_on_every_rank() -> None:
    results = run_ranks(_columns, 4)
    assert not any(isinstance(r, RankFailed) for r in results)
    first = results[0]
    # column 5: values {0: 5, 1: -1, 2: -3, 3: -1}: the reference is the biggest group, {1, 3}
    assert first[0] == ("t5", (1, 3), (0, 2))
    assert first[1] == ("t7", (0, 1, 3), (2,))
    assert first[2] == b"from two"
    assert "could not decide a failing rule" in first[3] and "bad rule" in first[3]
    assert first[4] == b"0123"  # a rule that raised leaves the channel usable
    assert all(r == first for r in results)


def _bucketed(rank: int, world: int, n: int, odd: dict) -> tuple[list[Any], int]:
    from weightsync_audit.channel.star import Comm

    comm = Comm(timeout_s=30)
    comm.setup()
    digests = np.arange(n, dtype=np.int64) * 7919
    for column, ranks in odd.items():
        if rank in ranks:
            digests[column] = -1 - rank
    before = comm.sent_bytes
    diffs = compare_columns(comm, [f"t{i}" for i in range(n)], digests)
    return [(d.uid, d.reference_ranks, d.ranks) for d in diffs], comm.sent_bytes - before


def test_a_divergence_among_many_tensors_is_localized_in_two_rounds_the_same_as_in_one() -> None:
    odd = {3: (2,), 999: (1, 3), 1000: (2,), 4095: (0,)}
    results = run_ranks(_bucketed, 4, 4096, odd)
    first = results[0][0]
    assert first == [
        ("t3", (0, 1, 3), (2,)),
        ("t999", (0, 2), (1, 3)),
        ("t1000", (0, 1, 3), (2,)),
        ("t4095", (1, 2, 3), (0,)),
    ]
    assert all(r[0] == first for r in results)
    # Each rank sent a digest per bucket of 64 and then 4 buckets' digests: far less than 8 bytes x 4,096.
    assert all(sent < 8 * 4096 // 4 for _, sent in results[1:])


def _compact(rank: int, world: int, uneven: bool) -> Any:
    from weightsync_audit.channel.star import Comm

    comm = Comm(timeout_s=30)
    comm.setup()  # opening the channel is a round of its own
    row = np.array([7, 0, -1, 2**40], dtype=np.int64)
    if rank == 2:
        row[1:3] = (5, 9)  # the odd rank: only its two cells come back
    if uneven and rank == 1:
        row = row[:3]
    before = comm.sent_bytes
    try:
        table = comm.exchange(row, "the compact rows", compact=True)
    except Exception as exc:  # noqa: BLE001 - returned to compare across ranks
        return type(exc).__name__, str(exc)
    sent = comm.sent_bytes - before
    return table.tolist(), comm.exchange(row, "the full rows").tolist(), sent


def test_a_compact_exchange_gives_every_rank_the_same_table_as_a_full_one_in_a_fixed_answer() -> None:
    out = run_ranks(_compact, 4, False)
    assert all(o[0] == o[1] == out[0][0] for o in out), out
    assert out[0][0][2] == [7, 5, 9, 2**40] and out[0][0][3] == [7, 0, -1, 2**40]
    # the compact answer (its length, the row length, 4 majority values, 2 cells as index and value:
    # 10 words) rides the reply frame's 4-word header: 14 words to each peer, however many ranks agree
    assert out[0][2] == 3 * 14 * 8


def test_compact_rows_of_different_lengths_are_out_of_step_on_every_rank() -> None:
    out = run_ranks(_compact, 3, True)
    assert all(o[0] == "AuditOutOfStepError" for o in out) and len({o[1] for o in out}) == 1
    assert "3 value(s)" in out[0][1]


def _sketched(rank: int, world: int) -> dict[str, Any]:
    from weightsync_audit.channel.star import Comm
    from weightsync_audit.engine.agreement.rounds import bucket_sketch, localize_values

    comm = Comm(timeout_s=30)
    comm.setup()
    digests = np.arange(1000, dtype=np.int64) * 7919
    if rank == 2:
        digests[700] = -5
    _, full = bucket_sketch(digests)
    group = comm._group
    out: dict[str, Any] = {}
    for label, candidates in (("right", (21,)), ("hidden", ()), ("wrong", (3,))):
        before = group.sent_messages
        diffs = localize_values(comm, [f"t{i}" for i in range(1000)], digests, candidates, full)
        out[label] = ([(d.uid, d.ranks) for d in diffs], group.sent_messages - before)
    return out


def test_a_sketch_that_hides_the_differing_bucket_is_caught_by_the_check_and_every_tensor_is_compared() -> None:
    # 1,000 digests in 32 buckets of 32: tensor 700 lies in bucket 21. Told the right bucket, one round
    # compares its 32 tensors; told none or another (what a 16-bit sketch collision would say), the check
    # word of the other buckets differs on rank 2, and every rank falls back to the whole column alike.
    results = run_ranks(_sketched, 4)
    for r in results:
        assert r["right"][0] == r["hidden"][0] == r["wrong"][0] == [("t700", (2,))]
    assert results[1]["right"][1] == 1  # one message up from a peer: the candidate bucket's digests
    assert results[1]["hidden"][1] == results[1]["wrong"][1] == 3  # the failed check, then two rounds


def _divergent_rounds(rank: int, world: int) -> tuple[int, str]:
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4)) for _ in range(1000)])
    auditor = Auditor(model, timeout_s=30)
    assert auditor.audit(step=0).in_sync
    if rank == 1:
        with torch.no_grad():
            model[500][0] += 1
    before = auditor.comm._group.sent_messages
    result = auditor.audit(step=1)
    (m,) = result.mismatches
    return auditor.comm._group.sent_messages - before, f"{m.name} {m.ranks} {m.max_abs_diff} {bool(result.hints)}"


def test_a_divergence_of_a_small_tensor_among_1000_takes_three_rounds_with_its_gap_and_hints() -> None:
    # summary (with the bucket sketch), the candidate bucket's digests, the layouts round that carries
    # the copies of the small diverged tensor, measured by the coordinator, and the hints
    results = run_ranks(_divergent_rounds, 4)
    assert [r[0] for r in results[1:]] == [3, 3, 3]
    assert {r[1] for r in results} == {"500 [1] 1.0 True"}


def _frames_kept_until_a_failure(rank: int, world: int) -> tuple[bool, int, bool]:
    import time

    from weightsync_audit import AuditTimeoutError
    from weightsync_audit.channel.star import Comm

    comm = Comm(timeout_s=2)
    comm.setup()
    group = comm._group
    assert group is not None
    comm.decide(bytes(100), lambda parts: b"ok", "first")
    kept = {k: t.data_ptr() for k, (_, t) in group.scratch.items()}
    comm.decide(bytes([1]) * 100, lambda parts: b"no", "second")  # other bytes, the same buffers
    same = kept == {k: t.data_ptr() for k, (_, t) in group.scratch.items()}
    if rank:
        time.sleep(4)  # misses the third round: the coordinator's wait fails
        return same, len(kept), True
    try:
        comm.decide(b"x", lambda parts: b"ok", "third")
    except AuditTimeoutError:
        return same, len(kept), not group.scratch  # a failed wait's buffer may still be gloo's: none kept
    return same, len(kept), False


def test_frame_buffers_are_reused_between_rounds_and_forgotten_after_a_failed_wait() -> None:
    results = run_ranks(_frames_kept_until_a_failure, 2, timeout=60)
    assert all(same and n > 0 and forgotten for same, n, forgotten in results), results
