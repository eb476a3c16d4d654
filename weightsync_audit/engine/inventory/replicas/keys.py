"""Replica keys: how an adapter says which ranks hold a replica of a tensor, on the DTensor peer-key rails.

Every audited entry may carry a :class:`~weightsync_audit.engine.inventory.peers.ShardInfo`; the audit
gathers one peer key per rank and entry and compares a tensor only among the ranks with equal keys
(:mod:`~weightsync_audit.engine.agreement.rounds`). The engines add two layouts to the DTensor ones:

- :func:`among`: "compared among the ranks of this group" (an FSDP1 HYBRID_SHARD replicate group, the
  data-parallel group of a pipeline stage, an expert's data-parallel group). The key hashes the group's
  global ranks, so ranks of one group agree and ranks of another never meet them. Its layout starts with
  :data:`HOLDERS`: ranks outside every group of that name may lack the tensor altogether.
- :func:`alone`: one owner (a ZeRO partition, an FSDP1 shard, a ZeRO-3 placeholder): key ``NEVER``,
  never compared, never counted in ``checked``, counted in the record's one note instead.

>>> alone("ZeRO-3 partitioned parameter", (4, 2)).key == NEVER
True
>>> among("pp", (0, 2), {"stage": 0}, (3,)).key == among("pp", (0, 2), {"stage": 0}, (3,)).key
True
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import xxhash

from weightsync_audit.engine.inventory.peers import FOUND, HOLDERS, NEVER, ShardInfo

__all__ = [
    "FOUND",
    "HOLDERS",
    "UNREPLICATED",
    "among",
    "alone",
    "stage_found",
    "in_stage",
    "holders_label",
    "unreplicated_label",
    "unreplicated_label_of",
    "is_holders",
]


UNREPLICATED = "unreplicated:"
"""Layout prefix of a tensor held by one rank only: never compared."""


def among(
    label: str, ranks: Sequence[int], coords: dict[str, int], shape: tuple[int, ...], *, declared: bool = False
) -> ShardInfo:
    """Compared among global ``ranks`` (this rank's group); ``coords`` name the copy in a mismatch.
    ``declared``: the group is known, named by the user (:func:`~weightsync_audit.declare_replicas`) or read
    from the engine (Megatron's ``parallel_state``), so every one of ``ranks`` must hold the tensor, alike: a
    member lacking it is a structure difference, as strictly as between DDP replicas. This is how an adapter
    declares a group it knows (a new integration fills :class:`~.rules.Rules` with such rules)."""
    group = tuple(sorted(int(r) for r in ranks))
    key = (xxhash.xxh3_64_intdigest(f"{label}|{group}".encode()) >> 2) | 2  # never ALL (0) nor NEVER (1)
    return ShardInfo(f"{HOLDERS}{label}", tuple(shape), dict(coords), key, members=group if declared else ())


def stage_found(index: int, stages: int, shape: tuple[int, ...]) -> ShardInfo:
    """A tensor of pipeline stage ``index`` of ``stages``, its replicas on the ranks of the same stage
    (found by the audit from the keys: :data:`FOUND`)."""
    key = (xxhash.xxh3_64_intdigest(f"pipeline stage|{index}|{stages}".encode()) >> 2) | 2
    return ShardInfo(f"{HOLDERS}pipeline stage", tuple(shape), {"stage": index}, key, members=FOUND)


def in_stage(info: ShardInfo, stage: int) -> ShardInfo:
    """A DTensor of a declared pipeline stage ``stage``: compared among the ranks of that stage holding the
    same shard only (the DTensor's own peers, as :func:`~weightsync_audit.engine.inventory.peers.shard_info`
    finds them, within the stage). A mesh flattened from the world (torchtitan's) has no ``pp`` dimension to
    tell the stages apart; the declaration does. A shard compared with nothing, or already tied to its stage
    by its mesh, is left as it is.

    >>> from weightsync_audit.engine.inventory.peers import ShardInfo
    >>> a, b = (in_stage(ShardInfo("(dp):(Shard(dim=0),)", (4,), {"dp": 0}, 7), s) for s in (0, 1))
    >>> a.key != b.key, a.coords
    (True, {'pp': 0, 'dp': 0})
    """
    if info.key == NEVER or info.layout.startswith(HOLDERS):
        return info
    key = (xxhash.xxh3_64_intdigest(f"pipeline stage|{stage}|{info.key}".encode()) >> 2) | 2
    layout = f"{HOLDERS}pipeline stage|{info.layout}"
    return replace(info, layout=layout, coords={"pp": stage, **info.coords}, key=key, members=FOUND)


def alone(label: str, shape: tuple[int, ...]) -> ShardInfo:
    """Held by this rank only (``label`` says what it is, e.g. ``ZeRO optimizer partition``)."""
    return ShardInfo(f"{UNREPLICATED}{label}", tuple(shape), {}, NEVER, f"a {label} is held by one rank only")


def unreplicated_label(info: ShardInfo | None) -> str | None:
    """What an unreplicated entry is (``None`` for anything compared, DTensors included)."""
    return None if info is None else unreplicated_label_of(info.layout)


def unreplicated_label_of(layout: str) -> str | None:
    """:func:`unreplicated_label` from the layout text alone (as the gathered manifests carry it)."""
    return layout[len(UNREPLICATED) :] if layout.startswith(UNREPLICATED) else None


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
