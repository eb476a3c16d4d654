"""What DistributedDataParallel really synchronises, and re-wrapping it when that goes stale.

DDP builds its gradient reducer once, at construction, over the parameters that require grad then.
A parameter unfrozen later gets no all-reduce hook: each rank steps it with its local gradient and the
replicas drift (Lightning #20340, pytorch#12603). A parameter frozen later is still expected by the
reducer: its bucket never becomes ready, so the bucket's other gradients stay local and the next
forward raises "Expected to have finished reduction in the prior iteration".

The remedy is a new wrapper over the same module whenever the trainable set changes:
:func:`rewrap_ddp` builds one with the old wrapper's settings and comm hooks, and :func:`maybe_rewrap`
does so only when the set has changed (cheap when it has not: one tuple of ``requires_grad`` flags).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from weightsync_audit.compat import ddp_reducer_parameter_ids, ddp_synced_count, remove_ddp_autograd_hooks
from weightsync_audit.text import brief_names

__all__ = [
    "TrainableChange",
    "ddp_settings",
    "find_ddp",
    "maybe_rewrap",
    "reduce_grads_by_hand",
    "remembered_flags",
    "rewrap_ddp",
    "synced_parameter_names",
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
    return list(getattr(ddp, "_comm_hooks", []) or [])


def _register_hooks(ddp: DistributedDataParallel, hooks: list[tuple[Callable[..., Any], object]]) -> None:
    for hook, state in hooks:
        ddp.register_comm_hook(state, hook)


def retire(ddp: DistributedDataParallel) -> None:
    """Detach an outgoing wrapper's reducer from the parameters, so it reduces nothing any more."""
    remove_ddp_autograd_hooks(ddp)


def rewrap_ddp(
    ddp: DistributedDataParallel,
    *,
    build: Callable[[nn.Module], DistributedDataParallel] | None = None,
    **overrides: Any,
) -> DistributedDataParallel:
    """A new DistributedDataParallel over ``ddp.module`` with the same settings and comm hooks.

    Call it on every rank at the same point whenever the set of trainable parameters changes, and use
    the returned wrapper from then on (including for ``no_sync``). It is collective: the new wrapper
    checks that every rank has the same trainable parameters and broadcasts rank 0's parameters, as
    any DDP construction does. The old wrapper's autograd hooks are removed so it reduces nothing.
    The optimizer needs no change: it holds the same parameter objects.

    Kept: process group, device ids, ``find_unused_parameters``, ``static_graph``,
    ``gradient_as_bucket_view``, bucket sizes, ``broadcast_buffers=False``, and the comm hooks
    registered with ``register_comm_hook`` (with their state objects). Not supported:
    ``mixed_precision`` (it installs hooks on the module itself, which a second wrapper would duplicate).

    ``build``: a factory that wraps the module the way its owner does (Lightning's
    ``strategy._setup_model``), used instead of the settings read from ``ddp``; ``overrides`` then
    do not apply.

    >>> # after unfreezing, on every rank: ddp = rewrap_ddp(ddp)
    """
    if getattr(ddp, "mixed_precision", None) is not None:
        raise ValueError("rewrap_ddp: a DistributedDataParallel with mixed_precision cannot be re-wrapped")
    settings = ddp_settings(ddp)
    settings.update(overrides)
    hooks = comm_hooks(ddp)
    retire(ddp)
    with torch.no_grad(), warnings.catch_warnings():
        # broadcast_buffers=False is deprecated in torch 2.13, but it is the only spelling that keeps
        # rank-local buffers as they are at construction.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        new = build(ddp.module) if build is not None else DistributedDataParallel(ddp.module, **settings)
    if not comm_hooks(new):  # a factory may register its own; DDP accepts one hook only
        _register_hooks(new, hooks)
    setattr(new, _FLAGS_ATTR, trainable_flags(new.module))
    return new


def maybe_rewrap(ddp: DistributedDataParallel, *, reduce_pending: bool = False) -> DistributedDataParallel:
    """``ddp`` itself while its reducer covers the trainable set; otherwise a re-wrapped one.

    For plain training loops: call it on every rank where the trainable set may have changed (after
    unfreezing or freezing, or simply before every forward) and use what it returns::

        for batch in loader:
            ddp = maybe_rewrap(ddp)
            loss = ddp(batch).sum(); loss.backward(); opt.step(); opt.zero_grad()

    Cost when nothing changed: one tuple of ``requires_grad`` flags compared with the one remembered
    for the wrapper (the first call on a wrapper not built by :func:`rewrap_ddp` reads the reducer
    once). The change is logged at INFO on the ``weightsync_audit`` logger.

    ``reduce_pending``: call it between ``backward()`` and ``optimizer.step()`` with True when the
    change may have happened after this step's forward; the gradients the old reducer missed are then
    averaged by hand first (see :func:`reduce_grads_by_hand`), so this step is in sync too.
    """
    before = covered_flags(ddp)
    now = trainable_flags(watched_parameters(ddp))
    if now == before:
        return ddp
    change = flags_change(ddp.module, before, now)
    if reduce_pending:
        reduce_grads_by_hand(ddp, change, before)
    new = rewrap_ddp(ddp)
    log.info("weightsync: re-wrapped DistributedDataParallel, trainable set changed (%s)", change.describe())
    return new


def reduce_grads_by_hand(ddp: DistributedDataParallel, change: TrainableChange, covered: tuple[bool, ...]) -> list[str]:
    """Average across ranks the gradients that ``ddp``'s reducer did not, after a change mid-step.

    For a backward run under the stale reducer: the parameters that joined were never reduced; when
    some left, their buckets never became ready, so (not knowing which buckets those were) every
    gradient the reducer covers is averaged: the reducer never finalised, so those gradients are
    still the local ones. Exact, except with ``gradient_as_bucket_view=True`` and parameters that
    left: the buckets that did complete were reduced in place without being finalised, and their
    scale cannot be known here (a warning says so; the replicas still agree). One collective for all of
    them; a gradient that is ``None`` on some ranks counts as zero there. Collective: every rank calls
    it with the same ``change``. Returns the names reduced.
    """
    if not change:
        return []
    names_params = list(ddp.module.named_parameters())
    joined = set(change.joined)
    pick = [
        (n, p)
        for (n, p), was in zip(names_params, covered)
        if p.requires_grad and (n in joined or (change.left and was))
    ]
    if not pick:
        return []
    group = ddp.process_group
    world = dist.get_world_size(group)
    if change.left:
        # The stale reducer may still have all-reduces in flight on buckets that did complete (with
        # gradient_as_bucket_view they write into the gradients in place): a barrier on the same group
        # runs after them, so the gradients read below are settled.
        dist.barrier(group=group)
        if ddp.gradient_as_bucket_view:
            # Those buckets' gradients were reduced in place but never finalised, so their scale is
            # the reducer's business (summed, not yet averaged, without a comm hook). Averaging keeps
            # the replicas in sync; this one step may take a larger update on those parameters.
            log.warning(
                "weightsync: %s were frozen between this step's forward and its optimizer step under "
                "gradient_as_bucket_view=True; the gradients are averaged so replicas stay in sync, but this "
                "step's update of parameters sharing their buckets may be scaled. Freeze before the forward "
                "(e.g. in on_train_epoch_start) to avoid it.",
                brief_names(change.left, 8),
            )
    device = pick[0][1].device
    dtypes = {p.dtype for _, p in pick}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64  # one buffer, no precision lost
    present = torch.tensor([p.grad is not None for _, p in pick], dtype=dtype, device=device)
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).to(dtype) for _, p in pick]
        + [present]
    )
    flat.div_(world)
    dist.all_reduce(flat, group=group)
    offset = 0
    for i, (_, p) in enumerate(pick):
        n = p.numel()
        if flat[-len(pick) + i] > 0:  # some rank has a gradient: every rank takes the average
            value = flat[offset : offset + n].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = value.clone()
            else:
                p.grad.copy_(value)
        offset += n
    return [n for n, _ in pick]
