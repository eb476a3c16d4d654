"""How ranks agree: pure functions from gathered data to a verdict.

Every rank runs these on the same gathered tables, so every rank reaches the same decision and takes
the same next step; nothing here talks to other ranks. The reference value of a tensor is the one most
ranks hold; a tie goes to the group holding the lowest rank, and is named as a tie (:func:`tie_groups`,
:func:`tie_detail`) so that no one mistakes it for a verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Literal, Sequence

import numpy as np

from weightsync_audit.engine.inventory.peers import (
    ALL,
    FOUND,
    carriers,
    column_peers,
    holders_label,
    is_holders,
    peer_sets,
    replica_groups,
    unreplicated_label,
)
from weightsync_audit.text import TIE_PREFIX, fmt_ranks, majority

__all__ = [
    "structure_row",
    "PROTOCOL",
    "PROTOCOL_FAILED",
    "SUMMARY_FIELDS",
    "Status",
    "Agreement",
    "majority",
    "majority_within",
    "tie_groups",
    "tie_detail",
    "tie_within",
    "union_counts",
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

SUMMARY_FIELDS = ("protocol", "step", "epoch", "count", "structure", "overall", "config", "slice", "ring")
"""The fixed-size summary each rank contributes: 9 int64 words, 72 bytes, followed by the 4-word bucket
sketch of :func:`~weightsync_audit.engine.agreement.rounds.bucket_sketch` (104 bytes in all). ``ring``: the
pinpoint ring's trace since the last audit (0 without pinpoint): equal values with other rings is a
transient divergence."""

_POSITION_FIELDS = ("protocol", "step", "epoch", "config", "slice")


Status = Literal["in_sync", "values", "structure", "out_of_step"]
"""What the summaries say: all equal, values differ, structures differ, or ranks are at different points."""


@dataclass(frozen=True, slots=True)
class Agreement:
    """Phase (a) on every rank: what the gathered summaries say, and whether some rank could not prepare its
    audit."""

    status: Status
    """``in_sync``, ``values`` (same structure, some value differs), ``structure`` or ``out_of_step``."""
    differing_fields: tuple[str, ...] = ()
    failed: bool = False
    candidates: tuple[int, ...] | None = None
    """On a divergence of values: the buckets whose sketches differ (each holding a differing tensor)."""


def majority_within(values: Sequence[Hashable], ranks: Sequence[int]) -> tuple[list[int], list[int]]:
    """:func:`majority` among ``ranks`` only (a peer set); ranks are returned as given, not as positions.

    >>> majority_within([5, 9, 7, 9], [1, 2, 3])
    ([1, 3], [2])
    """
    ref, other = majority([values[r] for r in ranks])
    return [ranks[i] for i in ref], [ranks[i] for i in other]


def tie_groups(values: Sequence[Hashable]) -> tuple[tuple[int, ...], ...]:
    """The groups of ranks tied for the largest group, reference first; empty when one group leads.

    >>> tie_groups([5, 5, 7, 7])
    ((0, 1), (2, 3))
    >>> tie_groups([5, 5, 7, 5])
    ()
    """
    groups: dict[Hashable, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    top = max(len(g) for g in groups.values())
    tied = sorted((tuple(g) for g in groups.values() if len(g) == top), key=lambda g: g[0])
    return tuple(tied) if len(tied) > 1 else ()


def tie_within(values: Sequence[Hashable], ranks: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """:func:`tie_groups` among ``ranks`` only (a peer set), in those ranks.

    >>> tie_within([5, 9, 7, 9, 7], [1, 2, 3, 4])
    ((1, 3), (2, 4))
    """
    return tuple(tuple(ranks[i] for i in g) for g in tie_groups([values[r] for r in ranks]))


def tie_detail(
    tie: Sequence[Sequence[int]], global_ranks: Sequence[int] | None = None, detail: str | None = None
) -> str | None:
    """``detail`` with the words a mismatch carries when its vote was a tie (in global ranks) added.

    >>> tie_detail([(0, 1), (2, 3)])
    'tie vote: ranks [0, 1] vs ranks [2, 3], no majority (the reference is the side holding the lowest rank)'
    """
    g = (lambda r: r) if global_ranks is None else (lambda r: global_ranks[r])
    sides = " vs ".join(fmt_ranks([g(r) for r in grp]) for grp in tie)
    if not tie:
        return detail
    note = f"{TIE_PREFIX}: {sides}, no majority (the reference is the side holding the lowest rank)"
    return f"{detail}; {note}" if detail else note


def union_counts(manifests: Sequence[Sequence[Sequence[Any]]], kinds: Sequence[str]) -> dict[str, int]:
    """Tensors per kind over the union of every rank's manifest: the same ``checked`` on every rank. A tensor
    that no other rank holds (one owner, or a replica group of one rank) is counted apart, by what it is
    (``"unreplicated:<what>"``), never in ``checked``."""
    per_rank, order = _read_rows(manifests)
    found = _found(per_rank)
    seen: dict[str, set[str]] = {k: set() for k in kinds}
    alone: dict[str, set[str]] = {}
    for uid, (kind, name) in order.items():
        layouts = [d[uid][3] for d in per_rank if uid in d]
        label = next((lbl for lay in layouts if (lbl := unreplicated_label(lay)) is not None), None)
        declared = any(d[uid][7] for d in per_rank if uid in d)
        if label is None and declared and _by_design(per_rank, uid, found) == []:
            label = holders_label(layouts[0])  # a declared replica group of one rank: no replica
        if label is None:
            seen.setdefault(kind, set()).add(name)
        else:  # never compared, counted apart ("unreplicated:<what>")
            alone.setdefault(f"unreplicated:{label}", set()).add(uid)
    return {k: len(seen.get(k, ())) for k in kinds} | {k: len(v) for k, v in alone.items()}


def judge_summaries(table: np.ndarray) -> Agreement:
    """Phase (a): ``table`` is ``[world, len(SUMMARY_FIELDS)]``; one row per rank."""
    table = np.asarray(table)
    same = (table == table[0]).all(axis=0)
    fields = dict(zip(SUMMARY_FIELDS, same))
    off = tuple(f for f in _POSITION_FIELDS if not fields[f])
    if off:
        return Agreement("out_of_step", off)
    if not (fields["count"] and fields["structure"]):
        return Agreement("structure", tuple(f for f in ("count", "structure") if not fields[f]))
    if not fields["overall"]:
        return Agreement("values", ("overall",))
    if not fields.get("ring", True):
        return Agreement("in_sync", ("ring",))  # equal now, but some step since the last audit was not
    return Agreement("in_sync")


@dataclass(frozen=True, slots=True)
class ValueDiff:
    """One tensor whose value differs while its name, shape and dtype agree."""

    uid: str
    reference_ranks: tuple[int, ...]
    ranks: tuple[int, ...]
    peer_set: tuple[int, ...] | None = None
    """For a sharded tensor, the ranks holding this shard (compared among themselves); ``None``: all ranks."""
    tie: tuple[tuple[int, ...], ...] = ()
    """The groups tied for the majority (reference first), when the vote was a tie."""


HOLDERS_VALUE = "value differs among the ranks holding it,"
"""Opening of the detail of a tensor held by some ranks by design whose value differs among them: reported
with its own kind (``param``...), not as a structure difference; its gap is measured among its holders."""


@dataclass(frozen=True, slots=True)
class StructureDiff:
    """One tensor missing on some ranks, or with another shape or dtype (or, see :data:`HOLDERS_VALUE`, a
    value that differs among the ranks holding a tensor that the others do not hold)."""

    uid: str
    kind: str
    name: str
    reference_ranks: tuple[int, ...]
    ranks: tuple[int, ...]
    shape: tuple[int, ...] | None
    dtype: str | None
    detail: str
    tie: tuple[tuple[int, ...], ...] = ()


def compare_digest_table(uids: Sequence[str], table: np.ndarray, peers: np.ndarray | None = None) -> list[ValueDiff]:
    """Phase (b): ``table`` is ``[world, n]`` per-tensor digests in the shared manifest order.

    ``peers`` (same shape) holds each rank's peer key per tensor (:mod:`weightsync_audit.engine.inventory.peers`);
    a majority is then taken within each peer set, and a rank alone in its set is compared with nothing.
    Without ``peers`` every rank is every tensor's peer.

    >>> [(d.uid, d.ranks) for d in compare_digest_table(["a", "b"], np.array([[1, 5], [1, 6], [2, 6], [1, 6]]))]
    [('a', (2,)), ('b', (0,))]
    >>> keys = np.array([[7], [9], [7], [9]])   # ranks 0, 2 hold one shard; 1, 3 the other
    >>> [(d.ranks, d.peer_set) for d in compare_digest_table(["w"], np.array([[1], [5], [1], [6]]), keys)]
    [((3,), (1, 3))]
    """
    table = np.asarray(table)
    if table.size == 0:
        return []
    world = table.shape[0]
    differs = np.nonzero(~(table == table[0]).all(axis=0))[0]
    out = []
    for j in differs.tolist():
        column = table[:, j].tolist()
        if peers is None or (np.asarray(peers)[:, j] == ALL).all():
            ref, other = majority(column)
            out.append(ValueDiff(uids[j], tuple(ref), tuple(other), tie=tie_groups(column)))
            continue
        for members in column_peers(peers, j, world):
            if len(members) < 2:
                continue
            ref, other = majority_within(column, members)
            if other:
                out.append(ValueDiff(uids[j], tuple(ref), tuple(other), tuple(members), tie_within(column, members)))
    return out


def structure_row(e: Any, digest: int, global_ranks: Sequence[int] = ()) -> list[Any]:
    """An entry's row for :func:`compare_manifests`: ``[kind, name, dtype, shape, digest]``, then, only where
    one of them is not the default, ``layout, peer_key, device, frozen``: the DTensor layout and peer key
    (``"", ALL`` for a plain tensor), the device type (``"cpu"``), and ``1`` for a frozen parameter
    (``requires_grad=False``: the trainable flag is part of the structure); then, for a tensor of a declared
    replica group (a pipeline stage's, an expert's), the group's members as positions in ``global_ranks``
    (the audit's ranks; members outside the audit are left out)."""
    row = [e.kind, e.name, e.dtype, list(e.shape), int(digest)]
    device = "cpu" if e.tensor.is_cpu else e.tensor.device.type
    frozen = bool(getattr(e, "frozen", False))
    if e.shard is not None or device != "cpu" or frozen:
        row += ["", ALL] if e.shard is None else [e.shard.layout, e.shard.key]
        row += [device, int(frozen)]
    members = getattr(e.shard, "members", ()) if e.shard is not None else ()
    if members == FOUND:
        row.append([-1])  # the group is found by the audit: the ranks carrying the same key
    elif members:
        where = {int(g): i for i, g in enumerate(global_ranks)} if global_ranks else None
        row.append([int(g) if where is None else where[int(g)] for g in members if where is None or g in where])
    return row


Row = tuple[str, tuple[int, ...], int, str, int, str, bool, tuple[int, ...]]
"""One rank's view of a tensor: dtype, shape, digest, layout, peer key, device type, frozen, and the
declared members of its replica group (positions; empty: none declared)."""


def _read_rows(manifests: Sequence[Sequence[Sequence[Any]]]) -> tuple[list[dict[str, Row]], dict[str, tuple[str, str]]]:
    """Each rank's rows by uid (``kind:name``), and every uid in first-seen order with its kind and name."""
    per_rank: list[dict[str, Row]] = []
    order: dict[str, tuple[str, str]] = {}
    for rows in manifests:
        d = {}
        for row in rows:
            kind, name, dtype, shape, digest = row[:5]
            layout, key = (str(row[5]), int(row[6])) if len(row) >= 7 else ("", ALL)
            device = str(row[7]) if len(row) >= 8 else "cpu"
            uid = f"{kind}:{name}"
            frozen = len(row) >= 9 and bool(row[8])
            members = tuple(int(r) for r in row[9]) if len(row) >= 10 else ()
            d[uid] = (dtype, tuple(shape), int(digest), layout, key, device, frozen, members)
            order.setdefault(uid, (kind, name))
        per_rank.append(d)
    return per_rank, order


def _differences(sigs: Sequence[Any], ref_sig: Any, other: Sequence[int]) -> list[str]:
    """What differs from the reference signature ``(dtype, shape, layout, device, frozen)``, per group of ranks."""
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
            if sig[2] != ref_sig[2]:
                what.append(f"layout {sig[2] or 'plain tensor'} instead of {ref_sig[2] or 'plain tensor'}")
            if sig[3] != ref_sig[3]:
                what.append(f"on device {sig[3]} instead of {ref_sig[3]}")
            if sig[4] != ref_sig[4]:
                what.append("frozen (requires_grad=False)" if sig[4] else "trainable (requires_grad=True)")
            parts.append(f"{' and '.join(what)} on {fmt_ranks(ranks)}")
    return parts


def _found(per_rank: Sequence[dict[str, Row]]) -> dict[int, set[int]]:
    """The ranks carrying each key of a group found by the audit (see :func:`.holders.carriers`)."""
    return carriers([((row[4], row[7]) for row in d.values() if row[7]) for d in per_rank])


def _by_design(
    per_rank: Sequence[dict[str, Row]], uid: str, found: dict[int, set[int]] | None = None
) -> list[tuple[list[int], list[int]]] | None:
    """The replica groups of a tensor held by some ranks by design (see :mod:`.holders`), ``None`` for any
    other tensor (a plain one, a DTensor, one held by design on every rank with no declared group)."""
    rows = [d.get(uid) for d in per_rank]
    held = [row for row in rows if row is not None]
    if not all(is_holders(row[3]) for row in held):
        return None
    if len(held) == len(rows) and not any(row[7] for row in held):
        return None
    return replica_groups(
        [None if row is None else row[4] for row in rows], [row[7] if row else () for row in rows], found
    )


def _judge_held(
    uid: str, kind: str, name: str, per_rank: Sequence[dict[str, Row]], groups: list[tuple[list[int], list[int]]]
) -> list[StructureDiff]:
    """Within each replica group: the structure (a member lacking the tensor, or holding it frozen, of
    another shape or dtype, or declared with another group, differs), then the values among the holders."""
    out = []
    for holders, group in groups:
        key = per_rank[holders[0]][uid][4]
        sigs: list[Any] = [None] * len(per_rank)
        for r in group:
            row = per_rank[r].get(uid)
            if row is not None:
                layout = row[3] if row[4] == key else f"{row[3]} of another replica group"
                sigs[r] = (row[0], row[1], layout, row[5], row[6])
        ref, other = majority_within(sigs, group)
        if other:
            ref_sig = sigs[ref[0]]
            detail = f"{kind} {'; '.join(_differences(sigs, ref_sig, other))} (replica group {fmt_ranks(group)})"
            shape, dtype = (ref_sig[1], ref_sig[0]) if ref_sig else (None, None)
            out.append(
                StructureDiff(uid, kind, name, tuple(ref), tuple(other), shape, dtype, detail, tie_within(sigs, group))
            )
            continue
        digests = [per_rank[r][uid][2] if r in holders else 0 for r in range(len(per_rank))]
        vref, vother = majority_within(digests, holders)
        if vother:
            dtype, shape = per_rank[vref[0]][uid][:2]
            detail = f"{HOLDERS_VALUE} {fmt_ranks(holders)}"
            out.append(
                StructureDiff(
                    uid, kind, name, tuple(vref), tuple(vother), shape, dtype, detail, tie_within(digests, holders)
                )
            )
    return out


def compare_manifests(manifests: Sequence[Sequence[Sequence[Any]]]) -> tuple[list[StructureDiff], list[ValueDiff]]:
    """Phase (c): each rank's manifest as rows ``[kind, name, dtype, shape, digest]``, optionally followed
    by ``layout, peer_key, device, frozen`` (see :func:`structure_row`; a DTensor's global shape in ``shape``).

    Returns the structure differences and, for tensors whose structure agrees everywhere, the value
    differences (within each peer set), so a missing layer does not hide a diverged one.
    """
    world = len(manifests)
    per_rank, order = _read_rows(manifests)
    found = _found(per_rank)
    structure: list[StructureDiff] = []
    values: list[ValueDiff] = []
    for uid, (kind, name) in order.items():
        sigs = [(d[uid][0], d[uid][1], d[uid][3], d[uid][5], d[uid][6]) if uid in d else None for d in per_rank]
        groups = _by_design(per_rank, uid, found)
        if groups is not None:
            # Held by some ranks by design (a pipeline stage's tensors, an expert's): compared within each
            # replica group only, its structure as strictly as DDP replicas' (a declared member lacking it
            # differs). Reported here, the same on every rank; a value's gap is measured among its holders.
            structure += _judge_held(uid, kind, name, per_rank, groups)
            continue
        ref, other = majority(sigs)
        if other:
            ref_sig = sigs[ref[0]]
            parts = _differences(sigs, ref_sig, other)
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
                    tie_groups(sigs),
                )
            )
            continue
        digests = [per_rank[r][uid][2] for r in range(world)]
        keys = [per_rank[r][uid][4] for r in range(world)]
        if all(k == ALL for k in keys):
            vref, vother = majority(digests)
            if vother:
                values.append(ValueDiff(uid, tuple(vref), tuple(vother), tie=tie_groups(digests)))
            continue
        for members in peer_sets(keys):
            if len(members) > 1:
                vref, vother = majority_within(digests, members)
                if vother:
                    values.append(
                        ValueDiff(uid, tuple(vref), tuple(vother), tuple(members), tie_within(digests, members))
                    )
    return structure, values
