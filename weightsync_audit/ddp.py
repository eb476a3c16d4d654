"""What DistributedDataParallel really synchronises, and re-wrapping it when that goes stale.

DDP builds its gradient reducer once, at construction, over the parameters that require grad then.
A parameter unfrozen later gets no all-reduce hook: each rank steps it with its local gradient and the
replicas drift (Lightning #20340, pytorch#12603). A parameter frozen later is still expected by the
reducer, which then fails or waits for a gradient that never comes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "find_ddp",
    "trainable_names",
    "TrainableChange",
    "ddp_settings",
    "rewrap_ddp",
    "synced_parameter_names",
]

log = logging.getLogger("weightsync_audit")


def find_ddp(module: Any) -> DistributedDataParallel | None:
    """The DistributedDataParallel wrapper in ``module``'s wrapper chain, if any."""
    seen = 0
    while module is not None and seen < 16:
        seen += 1
        if isinstance(module, DistributedDataParallel):
            return module
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


def _ignored(ddp: DistributedDataParallel) -> set[str]:
    return set(getattr(ddp, "parameters_to_ignore", ()) or ())


def synced_parameter_names(ddp: DistributedDataParallel) -> frozenset[str]:
    """Names of the parameters whose gradients ``ddp``'s reducer all-reduces.

    Reads the reducer's buckets; this allocates gradient-sized buffers, so it belongs on rare paths
    (after a divergence was found), never on every step.
    """
    ids: set[int] = set()
    for bucket in ddp.reducer._get_zeros_like_grad_buckets():
        ids.update(id(p) for p in bucket.parameters())
    return frozenset(n for n, p in ddp.module.named_parameters() if id(p) in ids)


def synced_count(ddp: DistributedDataParallel) -> int | None:
    """How many parameter tensors the reducer covers (cheap: DDP's own logging data)."""
    try:
        return int(ddp._get_ddp_logging_data()["num_parameter_tensors"])
    except Exception:  # noqa: BLE001 - private API; absent means unknown
        return None


@dataclass(frozen=True, slots=True)
class TrainableChange:
    """How the trainable set differs from what the DDP reducer was built over."""

    joined: tuple[str, ...]
    """Trainable now, not all-reduced by DDP (their replicas will drift)."""
    left: tuple[str, ...]
    """All-reduced by DDP, frozen now (DDP will wait for gradients that never come)."""

    def __bool__(self) -> bool:
        return bool(self.joined or self.left)


def trainable_change(ddp: DistributedDataParallel, synced: frozenset[str] | None = None) -> TrainableChange:
    """Compare the trainable set now with what ``ddp`` synchronises."""
    if synced is None:
        synced = synced_parameter_names(ddp)
    now = trainable_names(ddp.module) - _ignored(ddp)
    return TrainableChange(tuple(sorted(now - synced)), tuple(sorted(synced - now)))


_SETTINGS = (
    "device_ids",
    "output_device",
    "broadcast_buffers",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
)


def ddp_settings(ddp: DistributedDataParallel) -> dict[str, Any]:
    """The constructor arguments that re-create an equivalent wrapper."""
    kw: dict[str, Any] = {k: getattr(ddp, k) for k in _SETTINGS if hasattr(ddp, k)}
    kw["process_group"] = ddp.process_group
    kw["bucket_cap_mb"] = ddp.bucket_bytes_cap / (1024 * 1024)
    if kw.get("device_ids") is None:
        kw.pop("device_ids", None)
        kw.pop("output_device", None)
    if getattr(ddp, "mixed_precision", None) is not None:
        kw["mixed_precision"] = ddp.mixed_precision
    return kw


def rewrap_ddp(ddp: DistributedDataParallel, **overrides: Any) -> DistributedDataParallel:
    """A new DistributedDataParallel over ``ddp.module`` with the same settings and comm hooks.

    Call it on every rank at the same point (it is collective: DDP verifies and broadcasts the model
    at construction) whenever the set of trainable parameters changes, and use the returned wrapper
    from then on. The old wrapper's autograd hooks are removed so it no longer reduces anything.

    >>> # after unfreezing: ddp = rewrap_ddp(ddp)
    """
    settings = ddp_settings(ddp)
    settings.update(overrides)
    hooks = list(getattr(ddp, "_comm_hooks", []) or [])
    remove = getattr(ddp, "_remove_autograd_hooks", None)
    if callable(remove):
        remove()
    with torch.no_grad():
        new = DistributedDataParallel(ddp.module, **settings)
    for hook, state in hooks:
        new.register_comm_hook(state, hook)
    return new
