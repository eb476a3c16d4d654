"""Peers of a sharded tensor: which ranks hold the same shard of a DTensor, as pure functions.

A DTensor's local shard is compared only among its *peers*: the ranks that hold the same name,
global shape and placements, and the same coordinates on the mesh dimensions along which the tensor
is not replicated (by dimension name). Nothing else matters: a DP-only LayerNorm on the 1-D ``dp``
submesh ``[0, 2]`` of rank 0 and on ``[1, 3]`` of rank 1 has coordinate ``dp=0`` on both, so ranks 0
and 1 (its tensor-parallel peers) are compared although neither is in the other's mesh
(pytorch#160169). ``Partial`` placements hold partial sums, never comparable values.

Each rank describes its own shard with :func:`shard_info`; the audit gathers one 64-bit peer key per
rank and tensor, and :func:`peer_sets` splits the ranks of a column into the sets that are compared.
Key ``ALL`` (plain tensors) puts every rank in one set; key ``NEVER`` puts a rank alone.

The engines add two layouts to the DTensor ones (:mod:`~weightsync_audit.engine.inventory.replicas` fills
them in): :func:`among`, "compared among the ranks of this group" (an FSDP1 HYBRID_SHARD replicate group,
the data-parallel group of a pipeline stage, an expert's data-parallel group), whose key hashes the group's
global ranks and whose layout starts with :data:`HOLDERS`; and :func:`alone`, one owner (a ZeRO partition,
an FSDP1 shard, a ZeRO-3 placeholder): key ``NEVER``, never compared, never counted in ``checked``, counted
in the record's one note instead.

>>> alone("ZeRO-3 partitioned parameter", (4, 2)).key == NEVER
True
>>> among("pp", (0, 2), {"stage": 0}, (3,)).key == among("pp", (0, 2), {"stage": 0}, (3,)).key
True

The replica groups of a tensor held by some ranks by design (a pipeline stage's, an expert's), as a pure
function of what every rank gathered.

A rank holding such a tensor sends its peer key (which hashes its group's global ranks) and, for a group
whose members are known (declared by the user with :func:`~weightsync_audit.declare_replicas`, or read from
the engine: Megatron's ``parallel_state``; an adapter says so with ``among(..., declared=True)``), its members as positions in the
audit. The ranks with equal keys hold the same replicas; the declared members that are not among them
(the tensor is missing there, or declared with another group) belong to the group all the same: their
structure is compared with the holders', as strictly as DDP replicas'. A group of one rank has no replica
and is never compared nor counted in ``checked``.

>>> replica_groups([7, None, 7, 9], [(0, 2), (), (0, 2), (1, 3)])
[([0, 2], [0, 2]), ([3], [1, 3])]
>>> replica_groups([5, 6], [(0,), (1,)])   # one stage per rank: nothing has a replica
[]
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import xxhash

from weightsync_audit.compat import is_dtensor
from weightsync_audit.compat_engines import mesh_pipeline_coordinate

__all__ = [
    "ALL",
    "FOUND",
    "HOLDERS",
    "NEVER",
    "UNREPLICATED",
    "ShardInfo",
    "alone",
    "among",
    "carriers",
    "holders_label",
    "in_stage",
    "is_holders",
    "stage_found",
    "unreplicated_label",
    "replicated_everywhere",
    "column_peers",
    "peer_sets",
    "replica_groups",
    "shard_info",
    "unpaired_columns",
]


def carriers(per_rank: Sequence[Iterable[tuple[int, Sequence[int]]]]) -> dict[int, set[int]]:
    """For the keys of groups found by the audit (members ``[-1]``): the ranks carrying each key on some
    tensor. ``per_rank[r]``: rank r's ``(key, members)`` pairs.

    >>> carriers([[(7, [-1])], [(9, [-1])], [(7, [-1])], [(5, [0, 2])]])
    {7: {0, 2}, 9: {1}}
    """
    out: dict[int, set[int]] = {}
    for r, pairs in enumerate(per_rank):
        for key, members in pairs:
            if list(members) == [-1]:
                out.setdefault(int(key), set()).add(r)
    return out


def replica_groups(
    keys: Sequence[int | None], members: Sequence[Sequence[int]], found: Mapping[int, set[int]] | None = None
) -> list[tuple[list[int], list[int]]]:
    """Each replica group of one tensor as ``(holders, group)``: the ranks holding it with the group's key,
    and those ranks with the group's declared members (positions; none declared: the holders alone).

    ``keys[r]`` is rank r's peer key for the tensor (``None``: it does not hold it), ``members[r]`` the
    members rank r declared for it; members ``[-1]`` (``FOUND``): the ranks ``found[key]`` carrying the key
    on some tensor (:func:`carriers`). Groups of a single rank are left out; lowest rank first."""
    world = len(keys)
    out = []
    for holders in peer_sets([NEVER if k is None else int(k) for k in keys]):
        key = keys[holders[0]]
        if key is None:
            continue
        named = [int(r) for r in members[holders[0]]]
        declared = set((found or {}).get(int(key), ())) if named == [-1] else {r for r in named if 0 <= r < world}
        group = sorted(declared | set(holders))
        if len(group) > 1:
            out.append((holders, group))
    return out


ALL = 0
"""Peer key of a plain tensor: every rank is a peer (today's rule)."""

NEVER = 1
"""Peer key of a tensor that is compared with nothing (``Partial``, or a rank outside the mesh)."""

HOLDERS = "holders:"
"""Layout prefix of a tensor compared among its group's ranks only (present on those ranks only)."""

FOUND = (-1,)
"""The members of a group the audit finds itself: every rank carrying the same key (one pipeline stage's
ranks, the stage handed to the audit undeclared or its DTensors on a submesh of a mesh with a ``pp`` dim)."""


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """How one rank holds a DTensor."""

    layout: str
    """Mesh dimension names and placements, e.g. ``(dp,tp):(Shard(dim=0), Replicate())``: equal on every
    rank that holds the tensor, so it belongs to the structure that ranks compare."""
    shape: tuple[int, ...]
    """The global shape."""
    coords: dict[str, int] = field(default_factory=dict)
    """This rank's coordinates on the non-``Replicate`` mesh dimensions: the shard's name, ``{"dp": 0}``."""
    key: int = ALL
    """The peer key: ranks with equal keys (in the same column) hold the same shard."""
    why_not: str | None = None
    """Why the shard is compared with nothing (``Partial``, not in the mesh), else ``None``."""
    members: tuple[int, ...] = ()
    """For a replica group the user declared (a pipeline stage's, an expert's): its global ranks, every one
    of which must hold the tensor alike (empty: the ranks with equal keys, whoever they are)."""


def shard_info(t: Any) -> ShardInfo:
    """Describe the local shard of DTensor ``t`` on this rank (no communication)."""
    mesh = t.device_mesh
    placements = tuple(t.placements)
    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(len(placements))))
    layout = f"({','.join(names)}):({', '.join(map(str, placements))})"
    shape = tuple(int(s) for s in t.shape)
    if any(pl.is_partial() for pl in placements):
        return ShardInfo(layout, shape, {}, NEVER, "a Partial placement holds partial sums")
    coord = mesh.get_coordinate()
    if coord is None:
        return ShardInfo(layout, shape, {}, NEVER, "this rank is outside its mesh")
    coords = {names[d]: int(coord[d]) for d, pl in enumerate(placements) if not pl.is_replicate()}
    stage = mesh_pipeline_coordinate(mesh)
    if stage is not None:  # one pipeline stage's tensor: held by that stage's ranks only
        layout, coords = f"{HOLDERS}pipeline stage|{layout}", {"pp": stage, **coords}
    key = _key(f"{layout}|{shape}|{sorted(coords.items())}")
    return ShardInfo(layout, shape, coords, key, members=FOUND if stage is not None else ())


def _key(text: str) -> int:
    """The peer key of a layout's text: never one of the two reserved values, ``ALL`` (0) and ``NEVER`` (1)."""
    return (xxhash.xxh3_64_intdigest(text.encode()) >> 2) | 2


UNREPLICATED = "unreplicated:"
"""Layout prefix of a tensor held by one rank only: never compared."""


def among(
    label: str, ranks: Sequence[int], coords: dict[str, int], shape: tuple[int, ...], *, declared: bool = False
) -> ShardInfo:
    """Compared among global ``ranks`` (this rank's group); ``coords`` name the copy in a mismatch.
    ``declared``: the group is known, named by the user (:func:`~weightsync_audit.declare_replicas`) or read
    from the engine (Megatron's ``parallel_state``), so every one of ``ranks`` must hold the tensor, alike: a
    member lacking it is a structure difference, as strictly as between DDP replicas."""
    group = tuple(sorted(int(r) for r in ranks))
    key = _key(f"{label}|{group}")
    return ShardInfo(f"{HOLDERS}{label}", tuple(shape), dict(coords), key, members=group if declared else ())


def alone(label: str, shape: tuple[int, ...]) -> ShardInfo:
    """Held by this rank only (``label`` says what it is, e.g. ``ZeRO optimizer partition``)."""
    return ShardInfo(f"{UNREPLICATED}{label}", tuple(shape), {}, NEVER, f"a {label} is held by one rank only")


def stage_found(index: int, stages: int, shape: tuple[int, ...]) -> ShardInfo:
    """A tensor of pipeline stage ``index`` of ``stages``, its replicas on the ranks of the same stage
    (found by the audit from the keys: :data:`FOUND`)."""
    key = _key(f"pipeline stage|{index}|{stages}")
    return ShardInfo(f"{HOLDERS}pipeline stage", tuple(shape), {"stage": index}, key, members=FOUND)


def in_stage(info: ShardInfo, stage: int) -> ShardInfo:
    """A DTensor of a declared pipeline stage ``stage``: compared among the ranks of that stage holding the
    same shard only (the DTensor's own peers, as :func:`shard_info` finds them, within the stage). A mesh
    flattened from the world (torchtitan's) has no ``pp`` dimension to tell the stages apart; the declaration
    does. A shard compared with nothing, or already tied to its stage by its mesh, is left as it is.

    >>> a, b = (in_stage(ShardInfo("(dp):(Shard(dim=0),)", (4,), {"dp": 0}, 7), s) for s in (0, 1))
    >>> a.key != b.key, a.coords
    (True, {'pp': 0, 'dp': 0})
    """
    if info.key == NEVER or info.layout.startswith(HOLDERS):
        return info
    layout = f"{HOLDERS}pipeline stage|{info.layout}"
    key = _key(f"pipeline stage|{stage}|{info.key}")
    return replace(info, layout=layout, coords={"pp": stage, **info.coords}, key=key, members=FOUND)


def unreplicated_label(layout: str | ShardInfo | None) -> str | None:
    """What an unreplicated entry is, from its shard or its layout's text (as the gathered manifests carry
    it); ``None`` for anything compared, DTensors included."""
    text = layout.layout if isinstance(layout, ShardInfo) else layout or ""
    return text[len(UNREPLICATED) :] if text.startswith(UNREPLICATED) else None


def holders_label(layout: str) -> str | None:
    """What a tensor held by some ranks by design is, for a note (``pipeline stage tensor``), else ``None``.

    >>> holders_label(among("pipeline stage", (0, 2), {}, (2,)).layout)
    'pipeline stage tensor'
    """
    return f"{layout[len(HOLDERS) :].split('|')[0]} tensor" if layout.startswith(HOLDERS) else None


def is_holders(layout: str) -> bool:
    """Whether a layout says "held by some ranks by design": compared among its holders (an unreplicated
    tensor among nobody), so a rank without it is no structure difference."""
    return layout.startswith((HOLDERS, UNREPLICATED))


def replicated_everywhere(t: Any) -> bool:
    """Whether ``t`` holds the same values on every rank by design: a plain tensor, or a DTensor replicated on
    every dimension of a mesh that spans the world. The gradient of an FSDP2, HSDP or tensor-parallel shard
    is not (each rank holds its own shard), so attribution never compares it world-wide.

    >>> import torch
    >>> replicated_everywhere(torch.ones(2))
    True
    """
    if not is_dtensor(t):
        return True
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return all(pl.is_replicate() for pl in t.placements) and t.device_mesh.size() == world


def peer_sets(keys: Sequence[int]) -> list[list[int]]:
    """Split the ranks of one column (``keys[r]`` is rank r's peer key) into peer sets, lowest rank first.

    >>> peer_sets([7, 9, 7, 9])
    [[0, 2], [1, 3]]
    >>> peer_sets([0, 0, 0])
    [[0, 1, 2]]
    >>> peer_sets([1, 1])
    [[0], [1]]
    """
    sets: dict[int, list[int]] = {}
    out: list[list[int]] = []
    for r, k in enumerate(keys):
        k = int(k)
        if k == NEVER:
            out.append([r])
            continue
        if k not in sets:
            sets[k] = []
            out.append(sets[k])
        sets[k].append(r)
    return out


def column_peers(peers: np.ndarray | None, j: int, world: int) -> list[list[int]]:
    """The peer sets of column ``j`` of a ``[world, n]`` peer-key table (``None``: plain tensors only)."""
    if peers is None:
        return [list(range(world))]
    return peer_sets(np.asarray(peers)[:, j].tolist())


def unpaired_columns(peers: np.ndarray | None) -> list[int]:
    """Columns in which no rank has a peer: nothing of them can be compared."""
    if peers is None:
        return []
    table = np.asarray(peers)
    if table.shape[0] < 2:
        return []
    return [j for j in range(table.shape[1]) if all(len(s) == 1 for s in peer_sets(table[:, j].tolist()))]
