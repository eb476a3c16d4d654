"""What re-wrapping DistributedDataParallel needs to know: the trainable set, its changes, a wrapper's settings.

DDP builds its gradient reducer once, at construction, over the parameters that require grad then.
A parameter unfrozen later gets no all-reduce hook: each rank steps it with its local gradient and the
replicas drift (Lightning #20340, pytorch#12603). A parameter frozen later is still expected by the
reducer: its bucket never becomes ready, so the bucket's other gradients stay local and the next
forward raises "Expected to have finished reduction in the prior iteration".

The remedy, a new wrapper whenever the trainable set changes, is in :mod:`weightsync_audit.ddp.rewrap`;
this module reads what the reducer was built over (:func:`covered_flags`) against the trainable set now,
and the settings that re-create a wrapper. What an audit reads of a wrapper (the live one, what its
reducer covers, its buffer sync) is the engine's: :mod:`weightsync_audit.engine.explain.evidence`.

The watch during training (:class:`TrainableSetWatch`, framework-free, so every Trainer adapter uses it):
:meth:`~TrainableSetWatch.snapshot` right after the wrap, :meth:`~TrainableSetWatch.check` before each
optimizer step, warning once, before any weight moves, when the trainable set leaves the reducer behind.

>>> import torch
>>> TrainableSetWatch().check(torch.nn.Linear(2, 2), step=0)  # not wrapped by DDP: nothing to watch
False
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from weightsync_audit.compat import ddp_synced_count
from weightsync_audit.engine.explain.evidence import (
    ddp_frozen_hint,
    ddp_unsynced_hint,
    find_ddp,
    fix_for,
    remember_flags,
    remembered_flags,
    synced_parameter_names,
)
from weightsync_audit.errors import warn_user
from weightsync_audit.text import brief_names

__all__ = [
    "TrainableChange",
    "TrainableSetWatch",
    "covered_flags",
    "ddp_settings",
    "flags_change",
    "trainable_flags",
    "watched_parameters",
]

log = logging.getLogger("weightsync_audit")

_MIB = 1024 * 1024
_PARAMS_ATTR = "_weightsync_parameters"


def trainable_flags(module: nn.Module | Sequence[nn.Parameter]) -> tuple[bool, ...]:
    """``requires_grad`` of every parameter, in ``parameters()`` order: the cheap change detector.

    Given the parameter list itself (kept from an earlier ``list(module.parameters())``) it skips the
    module walk, which is most of the cost: about 50 us per 1000 parameter tensors instead of 600.
    """
    params = module.parameters() if isinstance(module, nn.Module) else module
    return tuple(p.requires_grad for p in params)


def watched_parameters(ddp: DistributedDataParallel) -> list[nn.Parameter]:
    """``ddp.module``'s parameters, listed once per wrapper (a wrapper's module does not change)."""
    params = getattr(ddp, _PARAMS_ATTR, None)
    if params is None:
        params = list(ddp.module.parameters())
        setattr(ddp, _PARAMS_ATTR, params)
    return params


def _ignored(ddp: DistributedDataParallel) -> set[str]:
    return set(getattr(ddp, "parameters_to_ignore", ()) or ())


@dataclass(frozen=True, slots=True)
class TrainableChange:
    """How the trainable set differs from what the DDP reducer was built over."""

    joined: tuple[str, ...]
    """Trainable now, not all-reduced by DDP (their replicas will drift)."""
    left: tuple[str, ...]
    """All-reduced by DDP, frozen now (DDP waits for gradients that never come)."""

    def __bool__(self) -> bool:
        return bool(self.joined or self.left)

    def describe(self) -> str:
        parts = []
        if self.joined:
            parts.append(f"joined: {brief_names(self.joined, 8)}")
        if self.left:
            parts.append(f"left: {brief_names(self.left, 8)}")
        return "; ".join(parts) or "no change"


def flags_change(module: nn.Module, before: tuple[bool, ...], after: tuple[bool, ...]) -> TrainableChange:
    """Which parameters joined or left the trainable set between two :func:`trainable_flags` tuples."""
    names = [n for n, _ in module.named_parameters()]
    joined = tuple(n for n, was, now in zip(names, before, after) if now and not was)
    left = tuple(n for n, was, now in zip(names, before, after) if was and not now)
    return TrainableChange(joined, left)


def covered_flags(ddp: DistributedDataParallel) -> tuple[bool, ...]:
    """The flags ``ddp``'s reducer was built over: remembered, or read from the reducer once."""
    flags = remembered_flags(ddp)
    if flags is None:
        # Cheap path first: when the reducer holds as many tensors as are trainable now (DDP's own
        # logging data), it was built over the trainable set. Reading its buckets allocates
        # gradient-sized buffers, too much to risk on a large model at fit start.
        ignored = _ignored(ddp)
        named = list(ddp.module.named_parameters())
        now = tuple(p.requires_grad for _, p in named)
        trainable = sum(1 for (n, _), f in zip(named, now) if f and n not in ignored)
        if ddp_synced_count(ddp) == trainable:  # cheap: DDP's own logging data
            remember_flags(ddp, now)
            return now
        try:
            synced = synced_parameter_names(ddp)
        except Exception as exc:  # noqa: BLE001 - private reducer API; fall back to "built over now"
            log.debug("weightsync: cannot read DDP's reducer (%s); assuming it covers the trainable set", exc)
            flags = trainable_flags(watched_parameters(ddp))
            remember_flags(ddp, flags)
            return flags
        # An ignored parameter is outside the reducer by design: count it as what it is now, so that
        # toggling it never looks like a change the reducer missed.
        flags = tuple((n in synced) or (n in ignored and p.requires_grad) for n, p in ddp.module.named_parameters())
        remember_flags(ddp, flags)
    return flags


def ddp_settings(ddp: DistributedDataParallel) -> dict[str, Any]:
    """The constructor arguments that re-create an equivalent wrapper over ``ddp.module``."""
    kw: dict[str, Any] = {
        "process_group": ddp.process_group,
        "dim": getattr(ddp, "dim", 0),
        "find_unused_parameters": bool(ddp.find_unused_parameters),
        "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
        "static_graph": bool(getattr(ddp, "static_graph", False)),
    }
    if getattr(ddp, "device_ids", None) is not None:
        kw["device_ids"] = list(ddp.device_ids)
        kw["output_device"] = ddp.output_device
    # Buffer broadcast: torch 2.13 stores it as ``forward_sync_buffers`` (``broadcast_buffers`` is a
    # deprecated alias). ``broadcast_buffers=False`` also skips the buffer broadcast at construction,
    # which is what a re-wrap mid-training wants for rank-local buffers; True is the default.
    if not getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True)):
        kw["broadcast_buffers"] = False
    # Bucket sizes: keep "default" as default (it gives the small first bucket), else the same caps.
    caps = list(getattr(ddp, "bucket_bytes_cap_list", []) or [])
    if caps:
        kw["bucket_cap_mb_list"] = [c / _MIB for c in caps]
    elif not getattr(ddp, "bucket_bytes_cap_default", False):
        kw["bucket_cap_mb"] = ddp.bucket_bytes_cap / _MIB
    if getattr(ddp, "skip_all_reduce_unused_params", False):
        kw["skip_all_reduce_unused_params"] = True
    if getattr(ddp, "batched_grad_copy", False):
        kw["batched_grad_copy"] = True
    return kw


class TrainableSetWatch:
    """Remembers what DDP's reducer covers and warns once when the trainable set moves away from it."""

    def __init__(self) -> None:
        self.warned = False
        self.said: list[str] = []
        """The hints the warning gave (a report that follows refers to them instead of repeating them)."""
        self._flags_seen: tuple[bool, ...] = ()

    def snapshot(self, model: Any) -> None:
        """Right after the wrap: what the reducer covers, remembered on the wrapper itself, so that a new
        wrapper (a re-wrap) is recognised by not carrying it yet."""
        ddp = find_ddp(model)
        if ddp is not None:
            covered_flags(ddp)

    def check(self, model: Any, step: int, *, warn: bool = True) -> bool:
        """Whether the trainable set left DDP's reducer behind (warned about once; ``warn`` on one rank)."""
        if self.warned:
            return False
        ddp = find_ddp(model)
        if ddp is None:
            return False
        covered = covered_flags(ddp)
        now = trainable_flags(watched_parameters(ddp))
        if now == covered or now == self._flags_seen:
            return False
        self._flags_seen = now
        change = flags_change(ddp.module, covered, now)
        parts = []
        if change.joined:
            parts.append(ddp_unsynced_hint(list(change.joined), fix=fix_for(ddp)))
        if change.left and not ddp.find_unused_parameters:
            parts.append(ddp_frozen_hint(list(change.left), fix=fix_for(ddp)))
        if not parts:
            return False
        self.warned = True
        if warn:
            self.said = parts
            warn_user(
                f"weightsync audit (step {step}): the set of trainable parameters changed after "
                "DistributedDataParallel wrapped the model. " + " ".join(parts)
            )
        return True
