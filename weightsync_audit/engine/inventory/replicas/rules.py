"""What the adapters decide, and how it is written onto a manifest's entries.

An adapter fills :class:`Rules`: a replica rule per parameter (by object), a rule for everything else
on the rank (buffers, hyper-parameters, scalar optimizer state), extra entries (a local check's
verdict) and wrapper prefixes to drop from names. :func:`apply_rules` then gives each entry its
:class:`~weightsync_audit.engine.inventory.peers.ShardInfo`: a parameter's gradient and its
optimizer state of the parameter's own shape follow the parameter (an FSDP1 shard's ``exp_avg`` is a
shard too), scalar state (``step``) follows the default.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from weightsync_audit.engine.inventory.manifest import Entry, Manifest
from weightsync_audit.engine.inventory.peers import ShardInfo
from weightsync_audit.engine.inventory.replicas.keys import among, in_stage

__all__ = ["Rules", "apply_rules", "named_params"]


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
