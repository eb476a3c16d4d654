"""Replica keys and rules: how an adapter says which ranks hold a replica of a tensor, on the DTensor peer-key rails.

Every audited entry may carry a :class:`~weightsync_audit.engine.inventory.peers.ShardInfo`; the audit
gathers one peer key per rank and entry and compares a tensor only among the ranks with equal keys
(:mod:`~weightsync_audit.engine.agreement.rounds`). The engines add two layouts to the DTensor ones:

- :func:`among`: "compared among the ranks of this group" (an FSDP1 HYBRID_SHARD replicate group, the
  data-parallel group of a pipeline stage, an expert's data-parallel group). The key hashes the group's
  global ranks, so ranks of one group agree and ranks of another never meet them. Its layout starts with
  :data:`HOLDERS`: ranks outside every group of that name may lack the tensor altogether.
- :func:`alone`: one owner (a ZeRO partition, an FSDP1 shard, a ZeRO-3 placeholder): key ``NEVER``,
  never compared, never counted in ``checked``, counted in the record's one note instead.

What the adapters decide (:class:`Rules`), and how it is written onto a manifest's entries:

An adapter fills :class:`Rules`: a replica rule per parameter (by object), a rule for everything else
on the rank (buffers, hyper-parameters, scalar optimizer state), extra entries (a local check's
verdict) and wrapper prefixes to drop from names. :func:`apply_rules` then gives each entry its
:class:`~weightsync_audit.engine.inventory.peers.ShardInfo`: a parameter's gradient and its
optimizer state of the parameter's own shape follow the parameter (an FSDP1 shard's ``exp_avg`` is a
shard too), scalar state (``step``) follows the default.

>>> alone("ZeRO-3 partitioned parameter", (4, 2)).key == NEVER
True
>>> among("pp", (0, 2), {"stage": 0}, (3,)).key == among("pp", (0, 2), {"stage": 0}, (3,)).key
True
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import xxhash
from torch import nn

from weightsync_audit.engine.inventory.manifest import Entry, Manifest
from weightsync_audit.engine.inventory.peers import FOUND, HOLDERS, NEVER, ShardInfo

__all__ = [
    "FOUND",
    "Rules",
    "apply_rules",
    "named_params",
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
    declares a group it knows (a new integration fills :class:`Rules` with such rules)."""
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


@dataclass
class Rules:
    """One audit's replica decisions (empty: every tensor is a replica on every rank, as under DDP)."""

    params: dict[int, ShardInfo] = field(default_factory=dict)
    """``id(parameter)`` (a module's or an optimizer's) to its rule."""
    default: ShardInfo | None = None
    """The rule of every other entry (``None``: compared on every rank)."""
    buffers: ShardInfo | None = None
    """The rule of buffers when it differs from ``default``."""
    by_name: Callable[[str], ShardInfo | None] | None = None
    """A rule chosen by the entry's (parameter's) name, e.g. expert parameters; wins over ``default``."""
    extra: list[Entry] = field(default_factory=list)
    """Entries added to the manifest (the verdict of a local check)."""
    strip: tuple[str, ...] = ()
    """Wrapper prefixes dropped from names (``_fsdp_wrapped_module.``)."""
    prefix: str = ""
    """Put before every name (a pipeline stage's own names collide with the other stages')."""
    stage: int | None = None
    """A declared pipeline stage's index: its DTensors are compared within the stage only
    (:func:`~.keys.in_stage`), whatever mesh they live on."""

    @property
    def empty(self) -> bool:
        return not (self.params or self.default or self.buffers or self.by_name or self.extra or self.strip)


def named_params(user: nn.Module | None) -> dict[str, Any]:
    """Parameters by the name the manifest gives them (first name of a shared one), as in its build."""
    out: dict[str, Any] = {}
    if user is None:
        return out
    seen: set[int] = set()
    for prefix, mod in user.named_modules():
        for key, value in mod._parameters.items():
            if value is not None and id(value) not in seen:
                seen.add(id(value))
                out[f"{prefix}.{key}" if prefix else key] = value
    return out


_SCALAR_OF_SHARD = among("scalar state of a sharded parameter", (), {}, (-1,))
"""``step`` of a parameter held in pieces: a replica wherever it exists, but a rank whose piece is empty
(FSDP1 ``use_orig_params=True``) has no state for it, and that is no structure difference."""


def _follows(info: ShardInfo, t: torch.Tensor, p: Any) -> ShardInfo:
    """A state tensor of its parameter's local shape is held the way the parameter is; others are scalars."""
    if isinstance(t, torch.Tensor) and t.dim() > 0 and tuple(t.shape) == tuple(p.shape):
        return info
    return _SCALAR_OF_SHARD


def apply_rules(
    manifest: Manifest, user: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer], rules: Rules
) -> None:
    """Write ``rules`` onto ``manifest``'s entries (in place)."""
    params = named_params(user)
    owner: dict[int, Any] = {}
    for opt in optimizers:
        for p, state in opt.state.items():
            owner[id(state)] = p
    kept: list[Entry] = []
    for e in manifest.entries:
        kept.append(e)
        if e.shard is not None:  # a DTensor keeps its own peers, within its declared stage
            if rules.stage is not None:
                e.shard = in_stage(e.shard, rules.stage)
            continue
        info: ShardInfo | None = rules.default
        p = None
        if e.kind in ("param", "grad"):
            p = params.get(e.name)
        elif e.kind == "optimizer" and id(e.container) in owner:
            p = owner[id(e.container)]
        if e.kind == "buffer" and rules.buffers is not None:
            info = rules.buffers
        if rules.by_name is not None:
            base = e.name if e.kind != "optimizer" or p is None else e.name.rsplit(".", 1)[0]
            info = rules.by_name(base) or info
        if p is not None and id(p) in rules.params:
            if e.kind == "grad" and e.dtype == "none" and p.numel() == 0:
                kept.pop()  # an empty local piece (FSDP1 use_orig_params=True) has no gradient: nothing held
                continue
            rule = rules.params[id(p)]
            info = rule if e.kind != "optimizer" else _follows(rule, e.tensor, p)
        if info is not None:
            if e.kind == "grad" and e.dtype == "none":
                info = replace(info, shape=())
            e.shard, e.shape = info, info.shape if info.shape != (-1,) else e.shape
    manifest.entries[:] = kept
    manifest.entries.extend(rules.extra)
    for e in manifest.entries:
        for s in rules.strip:
            if s in e.name:
                e.name = e.name.replace(s, "")
        if rules.prefix:
            e.name = rules.prefix + e.name
