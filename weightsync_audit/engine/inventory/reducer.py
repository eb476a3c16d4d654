"""What a DistributedDataParallel wrapper reduces, as an audit reads it: the live wrapper, its reducer's coverage.

An audit reads the wrapper it is given, or finds one in the module's wrapper chain (:func:`find_ddp`),
follows a wrapper that a re-wrap retired to its successor (:func:`live_ddp`), and, off the healthy path,
asks which parameters the reducer all-reduces (:func:`remembered_flags`, :func:`synced_parameter_names`)
and whether it syncs buffers (:func:`syncs_buffers`). Re-creating a wrapper and watching the trainable set
are the DDP adapter's (:mod:`weightsync_audit.ddp`); they write what is read here (:func:`mark_retired`,
:func:`remember_flags`, :data:`FIX_ATTR`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from weightsync_audit.compat import ddp_reducer_parameter_ids, module_attr

__all__ = [
    "FIX_ATTR",
    "find_ddp",
    "fix_for",
    "live_ddp",
    "mark_retired",
    "remember_flags",
    "remembered_flags",
    "synced_parameter_names",
    "syncs_buffers",
]

#: Attribute on a wrapper: the ``requires_grad`` flags of ``ddp.module.parameters()`` its reducer
#: was built over. Set by a re-wrap (known at construction) or, once, by the first read of the reducer.
_FLAGS_ATTR = "_weightsync_trainable_flags"
#: Attribute on a retired wrapper: True, or the wrapper that replaced it (see :func:`live_ddp`).
_SUCCESSOR_ATTR = "_weightsync_replaced_by"

#: Attribute on a wrapper: the fix its hints offer when its Trainer cannot re-wrap (the Hugging Face Trainer's).
FIX_ATTR = "_weightsync_fix"


def fix_for(ddp: object) -> str | None:
    """The fix a Trainer set on its wrapper (:data:`FIX_ATTR`), or ``None`` for the re-wrap fix."""
    return getattr(ddp, FIX_ATTR, None) if ddp is not None else None


def live_ddp(ddp: DistributedDataParallel | None) -> DistributedDataParallel | None:
    """The wrapper in use now: ``ddp``, or the one a re-wrap put in its place (followed to the end).

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
            cand = module_attr(module, attr) if attr != "module" or isinstance(module, nn.DataParallel) else None
            if isinstance(cand, nn.Module):
                nxt = cand
                break
        module = nxt
    return None


def remembered_flags(ddp: DistributedDataParallel) -> tuple[bool, ...] | None:
    """The flags ``ddp``'s reducer was built over when already known (set by a re-wrap or a first read)."""
    return getattr(ddp, _FLAGS_ATTR, None)


def remember_flags(ddp: DistributedDataParallel, flags: tuple[bool, ...]) -> None:
    """Record on the wrapper the flags its reducer was built over (known at construction by a re-wrap)."""
    setattr(ddp, _FLAGS_ATTR, flags)


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
