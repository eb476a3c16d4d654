"""What DistributedDataParallel really synchronises: its reducer's coverage, settings and comm hooks.

DDP builds its gradient reducer once, at construction, over the parameters that require grad then.
A parameter unfrozen later gets no all-reduce hook: each rank steps it with its local gradient and the
replicas drift (Lightning #20340, pytorch#12603). A parameter frozen later is still expected by the
reducer: its bucket never becomes ready, so the bucket's other gradients stay local and the next
forward raises "Expected to have finished reduction in the prior iteration".

The remedy, a new wrapper whenever the trainable set changes, is in :mod:`weightsync_audit.ddp.rewrap`;
this module only reads what a wrapper covers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from weightsync_audit.compat import ddp_comm_hooks, ddp_reducer_parameter_ids, ddp_synced_count
from weightsync_audit.text import brief_names

__all__ = [
    "TrainableChange",
    "ddp_settings",
    "FIX_ATTR",
    "find_ddp",
    "fix_for",
    "is_retired",
    "live_ddp",
    "mark_retired",
    "remember_flags",
    "remembered_flags",
    "synced_parameter_names",
    "syncs_buffers",
    "trainable_flags",
    "trainable_names",
    "watched_parameters",
]

log = logging.getLogger("weightsync_audit")

_MIB = 1024 * 1024

#: Attribute on a wrapper: the ``requires_grad`` flags of ``ddp.module.parameters()`` its reducer
#: was built over. Set by :func:`rewrap_ddp` (known at construction) or, once, by :func:`maybe_rewrap`.
_FLAGS_ATTR = "_weightsync_trainable_flags"
_PARAMS_ATTR = "_weightsync_parameters"
#: Attribute on a retired wrapper: True, or the wrapper that replaced it (see :func:`live_ddp`).
_SUCCESSOR_ATTR = "_weightsync_replaced_by"


#: Attribute on a wrapper: the fix its hints offer when its Trainer cannot re-wrap (the Hugging Face Trainer's).
FIX_ATTR = "_weightsync_fix"


def fix_for(ddp: object) -> str | None:
    """The fix a Trainer set on its wrapper (:data:`FIX_ATTR`), or ``None`` for the re-wrap fix."""
    return getattr(ddp, FIX_ATTR, None) if ddp is not None else None


def live_ddp(ddp: DistributedDataParallel | None) -> DistributedDataParallel | None:
    """The wrapper in use now: ``ddp``, or the one :func:`rewrap_ddp` put in its place (followed to the end).

    ``None`` when ``ddp`` was retired and what replaced it is not known: nothing it says about gradient
    reduction holds any more.
    """
    seen = 0
    while ddp is not None and seen < 1000:
        nxt = getattr(ddp, _SUCCESSOR_ATTR, None)
        if nxt is None:
            return ddp
        ddp = nxt if isinstance(nxt, DistributedDataParallel) else None
        seen += 1
    return ddp


def mark_retired(ddp: DistributedDataParallel, replaced_by: DistributedDataParallel | None = None) -> None:
    """Mark ``ddp`` retired, linked to the wrapper that replaced it once that is known."""
    setattr(ddp, _SUCCESSOR_ATTR, replaced_by if replaced_by is not None else True)


def is_retired(ddp: DistributedDataParallel) -> bool:
    """``ddp`` was retired (its reducer detached) by :func:`retire` or a re-wrap."""
    return getattr(ddp, _SUCCESSOR_ATTR, None) is not None


def find_ddp(module: Any) -> DistributedDataParallel | None:
    """The live DistributedDataParallel wrapper for ``module``'s wrapper chain, if any.

    A wrapper that a re-wrap retired is followed to the one that replaced it (:func:`live_ddp`), so an
    ``Auditor`` bound to the old wrapper reads what reduces gradients now, never a retired reducer.
    """
    seen = 0
    while module is not None and seen < 16:
        seen += 1
        if isinstance(module, DistributedDataParallel):
            return live_ddp(module)
        nxt = None
        for attr in ("_forward_module", "_orig_mod", "module"):
            cand = getattr(module, attr, None) if attr != "module" or isinstance(module, nn.DataParallel) else None
            if isinstance(cand, nn.Module):
                nxt = cand
                break
        module = nxt
    return None


def trainable_names(module: nn.Module) -> frozenset[str]:
    """Names of the parameters that require grad now (tied parameters once)."""
    return frozenset(n for n, p in module.named_parameters() if p.requires_grad)


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


def synced_parameter_names(ddp: DistributedDataParallel) -> frozenset[str]:
    """Names of the parameters whose gradients ``ddp``'s reducer all-reduces.

    Reads the reducer's buckets; this allocates gradient-sized buffers, so it belongs on rare paths
    (after a divergence was found, once per wrapper), never on every step.
    """
    ids = ddp_reducer_parameter_ids(ddp)
    if ids is None:
        raise RuntimeError("this torch's DistributedDataParallel does not expose its reducer's buckets")
    return frozenset(n for n, p in ddp.module.named_parameters() if id(p) in ids)


def syncs_buffers(ddp: DistributedDataParallel) -> bool:
    """Whether DDP overwrites buffers from its first rank at each forward.

    torch 2.13 names the setting ``forward_sync_buffers`` (``broadcast_buffers`` is its deprecated alias).
    """
    value = getattr(ddp, "forward_sync_buffers", None)
    if value is None:
        value = getattr(ddp, "broadcast_buffers", True)
    return bool(value)


def synced_count(ddp: DistributedDataParallel) -> int | None:
    """How many parameter tensors the reducer covers (cheap: DDP's own logging data)."""
    return ddp_synced_count(ddp)


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


def remembered_flags(ddp: DistributedDataParallel) -> tuple[bool, ...] | None:
    """The flags ``ddp``'s reducer was built over when already known (set by a re-wrap or a first read)."""
    return getattr(ddp, _FLAGS_ATTR, None)


def remember_flags(ddp: DistributedDataParallel, flags: tuple[bool, ...]) -> None:
    """Record on the wrapper the flags its reducer was built over (known at construction by a re-wrap)."""
    setattr(ddp, _FLAGS_ATTR, flags)


def covered_flags(ddp: DistributedDataParallel) -> tuple[bool, ...]:
    """The flags ``ddp``'s reducer was built over: remembered, or read from the reducer once."""
    flags = getattr(ddp, _FLAGS_ATTR, None)
    if flags is None:
        # Cheap path first: when the reducer holds as many tensors as are trainable now (DDP's own
        # logging data), it was built over the trainable set. Reading its buckets allocates
        # gradient-sized buffers, too much to risk on a large model at fit start.
        ignored = _ignored(ddp)
        named = list(ddp.module.named_parameters())
        now = tuple(p.requires_grad for _, p in named)
        trainable = sum(1 for (n, _), f in zip(named, now) if f and n not in ignored)
        if synced_count(ddp) == trainable:
            setattr(ddp, _FLAGS_ATTR, now)
            return now
        try:
            synced = synced_parameter_names(ddp)
        except Exception as exc:  # noqa: BLE001 - private reducer API; fall back to "built over now"
            log.debug("weightsync: cannot read DDP's reducer (%s); assuming it covers the trainable set", exc)
            flags = trainable_flags(watched_parameters(ddp))
            setattr(ddp, _FLAGS_ATTR, flags)
            return flags
        # An ignored parameter is outside the reducer by design: count it as what it is now, so that
        # toggling it never looks like a change the reducer missed.
        flags = tuple((n in synced) or (n in ignored and p.requires_grad) for n, p in ddp.module.named_parameters())
        setattr(ddp, _FLAGS_ATTR, flags)
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


def comm_hooks(ddp: DistributedDataParallel) -> list[tuple[Callable[..., Any], object]]:
    """The ``(hook, state)`` pairs registered with ``ddp.register_comm_hook``, oldest first."""
    return ddp_comm_hooks(ddp)
