"""Replica discovery: for every audited tensor, which ranks hold a replica of it, decided from the engine.

One adapter per engine fills the same table, :class:`~weightsync_audit.engine.inventory.replicas.engines.Rules`:

========================  ===============================================================================
DDP, plain replicas       nothing to fill: every tensor is compared on every rank (the cached fast path)
DTensor (FSDP2, HSDP, TP)  the tensor's own peers (:mod:`~weightsync_audit.engine.inventory.peers`)
DeepSpeed ZeRO 0-3        :mod:`.engines`
FSDP1                     :mod:`.engines`
pipeline stages, experts  :mod:`.declared` (:func:`declare_replicas`)
Megatron-core             :mod:`.megatron` (its ``parallel_state`` groups, its parameters' attributes)
========================  ===============================================================================

The table is resolved once per manifest build (:func:`replica_rules`: each engine asked once, over the
model's parameters named once) and written onto the manifest's entries (:func:`apply_rules`): a parameter's
gradient and its optimizer state of the parameter's own shape follow the parameter (an FSDP1 shard's
``exp_avg`` is a shard too), scalar state (``step``) follows the default.

A tensor with replicas is compared among their holders; a tensor with one owner is never compared and
never counted in ``checked``: the record says, in one note, how many there were and of which kinds
(:func:`~weightsync_audit.engine.agreement.rounds.sharded_notes`). Every decision reads the engine's own state, which is the same kind of state
on every rank, so every rank builds the same structure and takes the same path.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import nn

from weightsync_audit.engine.inventory.manifest import (
    Entry,
    Manifest,
    build_manifest,
    named_tensors,
    remember_wrapper,
    unwrap_module,
    unwrap_optimizer,
)
from weightsync_audit.engine.inventory.peers import ShardInfo, among, in_stage
from weightsync_audit.engine.inventory.replicas.declared import declare_replicas, declared_rules, stage_module
from weightsync_audit.engine.inventory.replicas.engines import Rules, deepspeed_rules, fsdp1_rules
from weightsync_audit.engine.inventory.replicas.megatron import megatron_rules

__all__ = [
    "Rules",
    "apply_rules",
    "declare_replicas",
    "detect_engine",
    "remember_wrapper",
    "reducing_engine",
    "replica_manifest",
    "replica_rules",
    "stage_module",
]


def replica_rules(
    module: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    include: Sequence[str],
    names: Sequence[str] = (),
) -> tuple[Rules, list[str], list[str]]:
    """The table, the engines that reduce the gradients themselves (DeepSpeed, FSDP1), and every engine:
    the model unwrapped and its parameters named once, each engine asked once."""
    user = unwrap_module(module) if module is not None else None
    rules = Rules(params_by_name=dict(named_tensors(user)) if user is not None else {})
    reducing = [
        deepspeed_rules(rules, user, optimizers, include, module),
        fsdp1_rules(rules, user, names, optimizers, include),
    ]
    megatron = megatron_rules(rules, module, user, optimizers, include)
    engines = [*reducing, megatron or declared_rules(rules, module, user)]
    return rules, [e for e in reducing if e], [e for e in engines if e]


def detect_engine(module: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer] = ()) -> list[str]:
    """The engines that hold ``module``'s tensors, e.g. ``["DeepSpeed ZeRO-2"]`` (empty: plain replicas).
    ``optimizers`` as the audit takes them (``engine.optimizer`` included)."""
    return replica_rules(module, [unwrap_optimizer(o) for o in optimizers], ())[2]


def reducing_engine(module: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer] = ()) -> str | None:
    """The engine that reduces ``module``'s gradients itself (DeepSpeed, FSDP1), ``None`` for DDP's or
    plain replicas, and for a declared layout (pipeline stages, expert groups), which reduces nothing."""
    return ", ".join(replica_rules(module, [unwrap_optimizer(o) for o in optimizers], ())[1]) or None


def replica_manifest(
    module: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    include: Sequence[str] = ("params", "buffers", "optimizer"),
    **settings: Any,
) -> Manifest:
    """The manifest of ``include`` with every entry's replica rule: what an audit compares and a resync copies
    (a plain model's is left as built).

    ``settings``: the rest of :func:`~weightsync_audit.engine.inventory.manifest.build_manifest`'s (exclude,
    skipped buffers), which leave entries out and change none of those kept."""
    manifest = build_manifest(module, optimizers, include=include, **settings)
    rules = replica_rules(module, optimizers, include, [e.name for e in manifest.entries])[0]
    if not rules.empty:
        apply_rules(manifest, optimizers, rules)
    return manifest


_SCALAR_OF_SHARD = among("scalar state of a sharded parameter", (), {}, (-1,))
"""``step`` of a parameter held in pieces: a replica wherever it exists, but a rank whose piece is empty
(FSDP1 ``use_orig_params=True``) has no state for it, and that is no structure difference."""


def apply_rules(manifest: Manifest, optimizers: Sequence[torch.optim.Optimizer], rules: Rules) -> None:
    """Write ``rules`` onto ``manifest``'s entries (in place)."""
    params = rules.params_by_name
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
            # A state tensor of its parameter's local shape is held the way the parameter is; others are scalars.
            t = e.tensor
            same = isinstance(t, torch.Tensor) and t.dim() > 0 and tuple(t.shape) == tuple(p.shape)
            info = rules.params[id(p)] if e.kind != "optimizer" or same else _SCALAR_OF_SHARD
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
