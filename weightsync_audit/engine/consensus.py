"""How ranks agree: pure functions from gathered data to a verdict.

Every rank runs these on the same gathered tables, so every rank reaches the same decision and takes
the same next step; nothing here talks to other ranks. The reference value of a tensor is the one most
ranks hold; a tie goes to the group holding the lowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Literal, Sequence

import numpy as np

from weightsync_audit.text import fmt_ranks

__all__ = [
    "PROTOCOL",
    "PROTOCOL_FAILED",
    "SUMMARY_FIELDS",
    "Status",
    "SummaryVerdict",
    "majority",
    "judge_summaries",
    "compare_digest_table",
    "compare_manifests",
    "ValueDiff",
    "StructureDiff",
]

PROTOCOL = 0x5753_4101
"""Protocol version, first word of every summary: 'WSA' and a version byte."""

PROTOCOL_FAILED = PROTOCOL | 0x80
"""First word of the summary of a rank that could not prepare its audit: every rank then raises."""

SUMMARY_FIELDS = ("protocol", "step", "epoch", "count", "structure", "overall", "config", "slice")
"""The fixed-size summary each rank contributes: 8 int64 words, 64 bytes."""

_POSITION_FIELDS = ("protocol", "step", "epoch", "config", "slice")


Status = Literal["in_sync", "values", "structure", "out_of_step"]
"""What the summaries say: all equal, values differ, structures differ, or ranks are at different points."""


@dataclass(frozen=True, slots=True)
class SummaryVerdict:
    """What phase (a) concludes from the gathered summaries."""

    status: Status
    """``in_sync``, ``values`` (same structure, some value differs), ``structure`` or ``out_of_step``."""
    differing_fields: tuple[str, ...] = ()


def majority(values: Sequence[Hashable]) -> tuple[list[int], list[int]]:
    """Split ranks into (reference ranks, differing ranks).

    The reference group is the largest group of equal values; a tie goes to the group holding the
    lowest rank.

    >>> majority([5, 5, 7, 5])
    ([0, 1, 3], [2])
    >>> majority([1, 2])
    ([0], [1])
    """
    groups: dict[Hashable, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    best = min(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))
    ref = set(best)
    return best, [r for r in range(len(values)) if r not in ref]


def judge_summaries(table: np.ndarray) -> SummaryVerdict:
    """Phase (a): ``table`` is ``[world, len(SUMMARY_FIELDS)]``; one row per rank."""
    table = np.asarray(table)
    same = (table == table[0]).all(axis=0)
    fields = dict(zip(SUMMARY_FIELDS, same))
    off = tuple(f for f in _POSITION_FIELDS if not fields[f])
    if off:
        return SummaryVerdict("out_of_step", off)
    if not (fields["count"] and fields["structure"]):
        return SummaryVerdict("structure", tuple(f for f in ("count", "structure") if not fields[f]))
    if not fields["overall"]:
        return SummaryVerdict("values", ("overall",))
    return SummaryVerdict("in_sync")


@dataclass(frozen=True, slots=True)
class ValueDiff:
    """One tensor whose value differs while its name, shape and dtype agree."""

    uid: str
    reference_ranks: tuple[int, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StructureDiff:
    """One tensor missing on some ranks, or with another shape or dtype."""

    uid: str
    kind: str
    name: str
    reference_ranks: tuple[int, ...]
    ranks: tuple[int, ...]
    shape: tuple[int, ...] | None
    dtype: str | None
    detail: str


def compare_digest_table(uids: Sequence[str], table: np.ndarray) -> list[ValueDiff]:
    """Phase (b): ``table`` is ``[world, n]`` per-tensor digests in the shared manifest order."""
    table = np.asarray(table)
    if table.size == 0:
        return []
    differs = np.nonzero(~(table == table[0]).all(axis=0))[0]
    out = []
    for j in differs.tolist():
        ref, other = majority(table[:, j].tolist())
        out.append(ValueDiff(uids[j], tuple(ref), tuple(other)))
    return out


def compare_manifests(manifests: Sequence[Sequence[Sequence[Any]]]) -> tuple[list[StructureDiff], list[ValueDiff]]:
    """Phase (c): each rank's manifest as rows ``[kind, name, dtype, shape, digest]``.

    Returns the structure differences and, for tensors whose structure agrees everywhere, the value
    differences, so a missing layer does not hide a diverged one.
    """
    world = len(manifests)
    per_rank: list[dict[str, tuple[str, tuple[int, ...], int]]] = []
    order: dict[str, tuple[str, str]] = {}
    for rows in manifests:
        d = {}
        for kind, name, dtype, shape, digest in rows:
            uid = f"{kind}:{name}"
            d[uid] = (dtype, tuple(shape), int(digest))
            order.setdefault(uid, (kind, name))
        per_rank.append(d)
    structure: list[StructureDiff] = []
    values: list[ValueDiff] = []
    for uid, (kind, name) in order.items():
        sigs = [(d[uid][0], d[uid][1]) if uid in d else None for d in per_rank]
        ref, other = majority(sigs)
        if other:
            ref_sig = sigs[ref[0]]
            groups: dict[Any, list[int]] = {}
            for r in other:
                groups.setdefault(sigs[r], []).append(r)
            parts = []
            for sig, ranks in groups.items():
                if sig is None:
                    parts.append(f"missing on {fmt_ranks(ranks)}")
                elif ref_sig is None:
                    parts.append(f"present only on {fmt_ranks(ranks)} ({sig[0]}, shape {list(sig[1])})")
                else:
                    what = []
                    if sig[0] != ref_sig[0]:
                        what.append(f"dtype {sig[0]} instead of {ref_sig[0]}")
                    if sig[1] != ref_sig[1]:
                        what.append(f"shape {list(sig[1])} instead of {list(ref_sig[1])}")
                    parts.append(f"{' and '.join(what)} on {fmt_ranks(ranks)}")
            structure.append(
                StructureDiff(
                    uid,
                    kind,
                    name,
                    tuple(ref),
                    tuple(other),
                    ref_sig[1] if ref_sig else None,
                    ref_sig[0] if ref_sig else None,
                    f"{kind} {'; '.join(parts)}",
                )
            )
            continue
        digests = [per_rank[r][uid][2] for r in range(world)]
        vref, vother = majority(digests)
        if vother:
            values.append(ValueDiff(uid, tuple(vref), tuple(vother)))
    return structure, values
