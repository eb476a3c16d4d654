"""Replica discovery: for every audited tensor, which ranks hold a replica of it, decided from the engine.

One adapter per engine fills the same :class:`~weightsync_audit.engine.inventory.replicas.keys.Rules`:

========================  ===============================================================================
DDP, plain replicas       nothing to fill: every tensor is compared on every rank (the cached fast path)
DTensor (FSDP2, HSDP, TP)  the tensor's own peers (:mod:`~weightsync_audit.engine.inventory.peers`)
DeepSpeed ZeRO 0-3        :mod:`.engines`
FSDP1                     :mod:`.engines`
pipeline stages, experts  :mod:`.declared` (:func:`declare_replicas`)
Megatron-core             :mod:`.megatron` (its ``parallel_state`` groups, its parameters' attributes)
========================  ===============================================================================

A tensor with replicas is compared among their holders; a tensor with one owner is never compared and
never counted in ``checked``: the record says, in one note, how many there were and of which kinds
(:func:`unreplicated_note`). Every decision reads the engine's own state, which is the same kind of state
on every rank, so every rank builds the same structure and takes the same path.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from weightsync_audit.engine.inventory.manifest import (
    Manifest,
    build_manifest,
    remember_wrapper,
    unwrap_module,
    unwrap_optimizer,
)
from weightsync_audit.engine.inventory.replicas.declared import declare_replicas, declared_rules, stage_module
from weightsync_audit.engine.inventory.replicas.engines import deepspeed_rules, fsdp1_rules
from weightsync_audit.engine.inventory.replicas.keys import Rules, apply_rules
from weightsync_audit.engine.inventory.replicas.megatron import megatron_rules

__all__ = [
    "assign_replicas",
    "declare_replicas",
    "detect_engine",
    "remember_wrapper",
    "reducing_engine",
    "replica_manifest",
    "stage_module",
]


def _rules(
    module: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    include: Sequence[str],
    names: Sequence[str] = (),
) -> tuple[Rules, list[str], list[str]]:
    """The rules, the engines that reduce the gradients themselves (DeepSpeed, FSDP1), and every engine."""
    rules = Rules()
    user = unwrap_module(module) if module is not None else None
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
    return _rules(module, [unwrap_optimizer(o) for o in optimizers], ())[2]


def reducing_engine(module: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer] = ()) -> str | None:
    """The engine that reduces ``module``'s gradients itself (DeepSpeed, FSDP1), ``None`` for DDP's or
    plain replicas, and for a declared layout (pipeline stages, expert groups), which reduces nothing."""
    return ", ".join(_rules(module, [unwrap_optimizer(o) for o in optimizers], ())[1]) or None


def assign_replicas(
    manifest: Manifest,
    module: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    include: Sequence[str] = ("params", "buffers", "optimizer"),
) -> Manifest:
    """Give every entry of ``manifest`` its replica rule (in place; returns it). A plain model: untouched."""
    rules, _, _ = _rules(module, optimizers, include, [e.name for e in manifest.entries])
    if not rules.empty:
        apply_rules(manifest, unwrap_module(module) if module is not None else None, optimizers, rules)
    return manifest


def replica_manifest(
    module: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    include: Sequence[str] = ("params", "buffers", "optimizer"),
    **settings: Any,
) -> Manifest:
    """The manifest of ``include`` with every entry's replica rule: what an audit compares and a resync copies.

    ``settings``: the rest of :func:`~weightsync_audit.engine.inventory.manifest.build_manifest`'s (exclude,
    skipped buffers), which leave entries out and change none of those kept."""
    return assign_replicas(build_manifest(module, optimizers, include=include, **settings), module, optimizers, include)
