"""The audit's decisions taken once, by the coordinator, and sent to every rank as one compact answer.

Each function here gathers every rank's data on the channel's coordinator, runs the pure function of
:mod:`~weightsync_audit.engine.agreement.consensus` on it there, and returns its result on every rank. So every
rank ends with the same verdict, while no rank receives the other ranks' data: a healthy audit answers
each rank a fixed-size verdict, and a divergence answers only the columns that differ.

>>> import numpy as np
>>> from weightsync_audit.channel.star import Comm
>>> agree(Comm(), np.zeros(8, dtype=np.int64)).status
'in_sync'

When the summaries say the audit cannot go on: a rank failed to prepare it, or the ranks are out of step.

Both are said alike on every rank, after one more round in which each rank tells what it knows (its
error, its position), so that every rank raises the same error naming the same ranks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import xxhash

from weightsync_audit.channel.star import Comm
from weightsync_audit.channel.wire import LEGACY_INLINE_BYTES
from weightsync_audit.engine.agreement.consensus import (
    PROTOCOL_FAILED,
    SUMMARY_FIELDS,
    StructureDiff,
    SummaryVerdict,
    ValueDiff,
    compare_digest_table,
    compare_manifests,
    judge_summaries,
    union_counts,
)
from weightsync_audit.engine.inventory.manifest import KINDS
from weightsync_audit.errors import AuditOutOfStepError, AuditPreparationError

__all__ = [
    "Agreement",
    "SKETCH_BUCKETS",
    "agree",
    "bucket_sketch",
    "compare_columns",
    "compare_structures",
    "localize_values",
    "raise_failed",
    "raise_out_of_step",
]


def raise_failed(comm: Comm, failure: BaseException | None) -> None:
    """Every rank's failure message shared; this rank's own error raised, or one naming the ranks that failed."""
    mine = "" if failure is None else f"{type(failure).__name__}: {failure}"
    messages = [b.decode("utf-8", "replace") for b in comm.exchange_bytes(mine.encode(), "the failure report")]
    if failure is not None:
        raise failure
    failed = {comm.global_ranks[r]: m for r, m in enumerate(messages) if m}
    text = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
    raise AuditPreparationError(
        f"weightsync audit could not run because other ranks failed to prepare it: {text}", failed
    )


def raise_out_of_step(comm: Comm, fields: Sequence[str], position: dict[str, Any]) -> None:
    """Every rank's ``position`` (step, epoch, hook, config, slice) shared, and the error naming each."""
    if "protocol" in fields:  # a rank may run the previous release: frames it can read, never abort on
        comm.inline_limit = LEGACY_INLINE_BYTES
    positions = [json.loads(b) for b in comm.exchange_bytes(json.dumps(position).encode(), "the out-of-step report")]
    lines = {}
    for r, p in enumerate(positions):
        where = [f"step {p['step']}", f"epoch {p['epoch']}", f"hook {p['hook']}"]
        if "config" in fields or "protocol" in fields:
            where.append(p["config"])
        if "slice" in fields:
            where.append(f"sample slice {p['slice']} (ranks audited a different number of times)")
        lines[comm.global_ranks[r]] = ", ".join(where)
    text = "; ".join(f"rank {r}: {w}" for r, w in lines.items())
    raise AuditOutOfStepError(
        f"ranks reached the weight audit out of step ({', '.join(fields)} differ), so their weights "
        f"cannot be compared: {text}",
        lines,
    )


SKETCH_BUCKETS = 32
"""Contiguous buckets of the digest column whose 8-bit sketches ride the summary (4 words, 32 bytes)."""


def bucket_sketch(digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The summary's sketch of ``digests`` (``SKETCH_BUCKETS`` 8-bit digests packed in 4 int64 words) and
    the buckets' full 64-bit digests (kept by the rank, for :func:`localize_values`)."""
    row = np.ascontiguousarray(digests, dtype=np.int64).reshape(-1)
    size = -(-row.size // SKETCH_BUCKETS) or 1
    full = np.array(
        [xxhash.xxh3_64_intdigest(row[b * size : (b + 1) * size]) >> 1 for b in range(SKETCH_BUCKETS)],
        dtype=np.int64,
    )
    return (full & 0xFF).astype(np.uint8).view(np.int64), full


def _candidates(sketches: np.ndarray) -> list[int]:
    """The buckets whose sketches differ between ranks (``sketches``: ``[world, 4]`` int64)."""
    table = np.ascontiguousarray(sketches).view(np.uint8)
    return np.flatnonzero((table != table[0]).any(axis=0)).tolist()


@dataclass(frozen=True, slots=True)
class Agreement:
    """Phase (a) on every rank: the summary verdict, and whether some rank could not prepare its audit."""

    status: str
    differing_fields: tuple[str, ...] = ()
    failed: bool = False
    candidates: tuple[int, ...] | None = None
    """On a divergence of values: the buckets whose sketches differ (each holding a differing tensor)."""

    @property
    def verdict(self) -> SummaryVerdict:
        return SummaryVerdict(self.status, self.differing_fields)


def _judge(parts: list[bytes]) -> bytes:
    if len({len(p) for p in parts}) > 1:  # another protocol version: its summary has another length
        return json.dumps({"s": "out_of_step", "f": ["protocol"], "x": False}).encode()
    table = np.frombuffer(b"".join(parts), dtype=np.int64).reshape(len(parts), -1)
    v = judge_summaries(table[:, : len(SUMMARY_FIELDS)])
    answer = {"s": v.status, "f": list(v.differing_fields), "x": bool((table[:, 0] == PROTOCOL_FAILED).any())}
    if v.status == "values":
        answer["b"] = _candidates(table[:, len(SUMMARY_FIELDS) :])
    return json.dumps(answer).encode()


def agree(comm: Comm, summary: np.ndarray) -> Agreement:
    """Phase (a): compare every rank's summary (its fields, then the sketch); one small answer per rank."""
    row = np.ascontiguousarray(summary, dtype=np.int64).reshape(-1)
    answer = json.loads(comm.decide(row, _judge, "the audit summary"))
    b = answer.get("b")
    return Agreement(answer["s"], tuple(answer["f"]), answer["x"], tuple(b) if b is not None else None)


def _columns(parts: list[bytes]) -> bytes:
    if len({len(p) for p in parts}) > 1:
        raise ValueError("ranks sent per-tensor digest vectors of different lengths")
    world = len(parts)
    table = np.frombuffer(b"".join(parts), dtype=np.int64).reshape(world, -1)
    diffs = compare_digest_table(range(table.shape[1]), table)  # type: ignore[arg-type]
    # Each set of differing ranks is written once, however many columns share it.
    sets: dict[tuple[int, ...], int] = {}
    cols = [[int(d.uid), sets.setdefault(d.ranks, len(sets)), [list(g) for g in d.tie] or None] for d in diffs]
    return json.dumps({"sets": [list(s) for s in sets], "cols": cols}).encode()


BUCKETS_FROM = 256
"""From this many tensors on, a divergence is localized in two rounds (buckets, then their entries)."""


def _bucket_size(n: int) -> int:
    return max(8, math.isqrt(n))  # ~sqrt(n): n/s bucket digests, then s digests per differing bucket


def _differing_buckets(parts: list[bytes]) -> bytes:
    if len({len(p) for p in parts}) > 1:
        raise ValueError("ranks sent bucket digests of different lengths")
    table = np.frombuffer(b"".join(parts), dtype=np.int64).reshape(len(parts), -1)
    return json.dumps(np.flatnonzero((table != table[0]).any(axis=0)).tolist()).encode()


def localize_values(
    comm: Comm, uids: Sequence[str], digests: np.ndarray, candidates: Sequence[int] | None, full: np.ndarray
) -> list[ValueDiff]:
    """Phase (b) after the summary's sketch: only the candidate buckets' tensors are compared, with a check
    that every other bucket agrees (its full digests, hashed: one word). A sketch that hid a differing
    bucket (one chance in 256 per differing bucket) fails the check on every rank alike, and every tensor
    is compared then: two rounds more, never a tensor missed.
    """
    row = np.ascontiguousarray(digests, dtype=np.int64).reshape(-1)
    if candidates is None or not comm.distributed:
        return compare_columns(comm, uids, row)
    size = -(-row.size // SKETCH_BUCKETS) or 1
    picked = [j for b in candidates for j in range(b * size, min(row.size, (b + 1) * size))]
    others = np.delete(full, list(candidates))
    check = xxhash.xxh3_64_intdigest(others.tobytes()) >> 1
    found = compare_columns(comm, [uids[j] for j in picked], row[picked], check=check)
    return found if found is not None else compare_columns(comm, uids, row)


def _checked(rule: Any) -> Any:
    """``rule`` on every rank's bytes but its last word, which must be the same everywhere (else ``b"!"``)."""

    def checked(parts: list[bytes]) -> bytes:
        if len({p[-8:] for p in parts}) > 1:
            return b"!"
        return rule([p[:-8] for p in parts])

    return checked


def compare_columns(comm: Comm, uids: Sequence[str], digests: np.ndarray, check: int | None = None) -> Any:
    """Phase (b): which tensors differ, with their reference and differing ranks, on every rank.

    From :data:`BUCKETS_FROM` tensors on, in two rounds, so that the bytes through the coordinator grow
    with the ranks and with what differs, not with the number of tensors: each rank sends one digest per
    bucket of about sqrt(n) tensors; every rank learns the differing buckets; then each sends only those
    buckets' digests. The coordinator finds each column's majority; each rank receives only the differing
    columns, each set of differing ranks once. ``check``: a word that must be the same on every rank,
    sent with the first round; ``None`` comes back on every rank when it is not (see :func:`localize_values`).
    """
    row = np.ascontiguousarray(digests, dtype=np.int64).reshape(-1)
    word = [] if check is None else [check]
    if row.size >= BUCKETS_FROM and comm.distributed:
        size = _bucket_size(row.size)
        buckets = np.array(
            [xxhash.xxh3_64_intdigest(row[i : i + size]) >> 1 for i in range(0, row.size, size)] + word,
            dtype=np.int64,
        )
        rule = _checked(_differing_buckets) if word else _differing_buckets
        answer = comm.decide(buckets, rule, "the bucket digests")
        if answer == b"!":
            return None
        picked = [j for b in json.loads(answer) for j in range(b * size, min(row.size, (b + 1) * size))]
        return _compare_picked(comm, [uids[j] for j in picked], row[picked])
    return _compare_picked(comm, uids, row, word)


def _compare_picked(comm: Comm, uids: Sequence[str], row: np.ndarray, word: list[int] | None = None) -> Any:
    payload = np.concatenate([row, np.array(word or [], dtype=np.int64)])
    raw = comm.decide(payload, _checked(_columns) if word else _columns, "the per-tensor digests")
    if raw == b"!":
        return None
    answer = json.loads(raw)
    sets = [tuple(s) for s in answer["sets"]]
    out = []
    for j, k, tie in answer["cols"]:
        odd = set(sets[k])
        ref = tuple(r for r in range(comm.world_size) if r not in odd)
        out.append(ValueDiff(uids[j], ref, sets[k], tie=tuple(tuple(g) for g in tie or ())))
    return out


def _structures(parts: list[bytes]) -> bytes:
    manifests = [json.loads(p) for p in parts]
    structure, values = compare_manifests(manifests)
    return json.dumps(
        {
            "s": [
                [d.uid, d.kind, d.name, d.reference_ranks, d.ranks, d.shape, d.dtype, d.detail, d.tie]
                for d in structure
            ],
            "v": [[d.uid, d.reference_ranks, d.ranks, d.peer_set, d.tie] for d in values],
            "c": union_counts(manifests, KINDS),  # counted over the union: the same ``checked`` everywhere
        }
    ).encode()


def compare_structures(
    comm: Comm, rows: list[list[Any]]
) -> tuple[list[StructureDiff], list[ValueDiff], dict[str, int]]:
    """Phase (c): each rank's manifest rows ``[kind, name, dtype, shape, digest]`` compared by the
    coordinator; every rank receives the differences only, and the tensors per kind over the union of
    the manifests (the same ``checked`` on every rank)."""
    answer = json.loads(comm.decide(json.dumps(rows).encode(), _structures, "the manifests"))
    structure = [
        StructureDiff(
            uid,
            kind,
            name,
            tuple(ref),
            tuple(odd),
            tuple(shape) if shape is not None else None,
            dtype,
            detail,
            tuple(tuple(g) for g in tie),
        )
        for uid, kind, name, ref, odd, shape, dtype, detail, tie in answer["s"]
    ]
    values = [
        ValueDiff(
            uid, tuple(ref), tuple(odd), tuple(peer_set) if peer_set is not None else None, tuple(map(tuple, tie))
        )
        for uid, ref, odd, peer_set, tie in answer["v"]
    ]
    return structure, values, answer["c"]
