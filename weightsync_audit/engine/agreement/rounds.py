"""The audit's decisions taken once, by the coordinator, and sent to every rank as one compact answer.

Each function here gathers every rank's data on the channel's coordinator, runs the pure function of
:mod:`~weightsync_audit.engine.agreement.consensus` on it there, and returns its result on every rank. So every
rank ends with the same verdict, while no rank receives the other ranks' data: a healthy audit answers
each rank a fixed-size verdict, and a divergence answers only the columns that differ.

>>> import numpy as np
>>> from weightsync_audit.channel.star import Comm
>>> agree(Comm(), np.zeros(8, dtype=np.int64)).status
'in_sync'
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import xxhash

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.agreement.consensus import (
    PROTOCOL_FAILED,
    StructureDiff,
    SummaryVerdict,
    ValueDiff,
    compare_digest_table,
    compare_manifests,
    judge_summaries,
    union_counts,
)
from weightsync_audit.engine.inventory.manifest import KINDS

__all__ = ["Agreement", "agree", "compare_columns", "compare_structures"]


@dataclass(frozen=True, slots=True)
class Agreement:
    """Phase (a) on every rank: the summary verdict, and whether some rank could not prepare its audit."""

    status: str
    differing_fields: tuple[str, ...] = ()
    failed: bool = False

    @property
    def verdict(self) -> SummaryVerdict:
        return SummaryVerdict(self.status, self.differing_fields)


def _judge(parts: list[bytes]) -> bytes:
    if len({len(p) for p in parts}) > 1:  # another protocol version: its summary has another length
        return json.dumps({"s": "out_of_step", "f": ["protocol"], "x": False}).encode()
    table = np.frombuffer(b"".join(parts), dtype=np.int64).reshape(len(parts), -1)
    v = judge_summaries(table)
    return json.dumps(
        {"s": v.status, "f": list(v.differing_fields), "x": bool((table[:, 0] == PROTOCOL_FAILED).any())}
    ).encode()


def agree(comm: Comm, summary: np.ndarray) -> Agreement:
    """Phase (a): compare every rank's summary; one fixed-size answer per rank."""
    row = np.ascontiguousarray(summary, dtype=np.int64).reshape(-1)
    answer = json.loads(comm.decide(row, _judge, "the audit summary"))
    return Agreement(answer["s"], tuple(answer["f"]), answer["x"])


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


def compare_columns(comm: Comm, uids: Sequence[str], digests: np.ndarray) -> list[ValueDiff]:
    """Phase (b): which tensors differ, with their reference and differing ranks, on every rank.

    From :data:`BUCKETS_FROM` tensors on, in two rounds, so that the bytes through the coordinator grow
    with the ranks and with what differs, not with the number of tensors: each rank sends one digest per
    bucket of about sqrt(n) tensors; every rank learns the differing buckets; then each sends only those
    buckets' digests. The coordinator finds each column's majority; each rank receives only the differing
    columns, each set of differing ranks once.
    """
    row = np.ascontiguousarray(digests, dtype=np.int64).reshape(-1)
    if row.size >= BUCKETS_FROM and comm.distributed:
        size = _bucket_size(row.size)
        buckets = np.array(
            [xxhash.xxh3_64_intdigest(row[i : i + size].tobytes()) >> 1 for i in range(0, row.size, size)],
            dtype=np.int64,
        )
        picked_buckets = json.loads(comm.decide(buckets, _differing_buckets, "the bucket digests"))
        picked = [j for b in picked_buckets for j in range(b * size, min(row.size, (b + 1) * size))]
        return _compare_picked(comm, [uids[j] for j in picked], row[picked])
    return _compare_picked(comm, uids, row)


def _compare_picked(comm: Comm, uids: Sequence[str], row: np.ndarray) -> list[ValueDiff]:
    answer = json.loads(comm.decide(np.ascontiguousarray(row), _columns, "the per-tensor digests"))
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
