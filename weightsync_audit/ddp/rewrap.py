"""Re-wrapping DistributedDataParallel when the trainable set changes, decided by every rank together.

DDP builds its gradient reducer once, at construction, over the parameters that require grad then.
A parameter unfrozen later gets no all-reduce hook: each rank steps it with its local gradient and the
replicas drift (Lightning #20340, pytorch#12603). A parameter frozen later is still expected by the
reducer: its bucket never becomes ready, so the bucket's other gradients stay local.

:func:`rewrap_ddp` builds a new wrapper with the old one's settings and comm hooks; :func:`maybe_rewrap`
does so when the set has changed. A re-wrap is collective (DDP's constructor broadcasts), so the
decision is agreed first: :func:`agree_trainable` exchanges a digest of every rank's ``requires_grad``
flags with a deadline, and ranks that disagree raise :class:`~weightsync_audit.TrainableSetMismatchError`
together, naming the parameters and ranks, instead of one rank entering DDP's constructor alone.
"""

from __future__ import annotations

import json
import logging
import warnings
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from weightsync_audit.channel.star import Comm
from weightsync_audit.compat import ddp_comm_hooks, remove_ddp_autograd_hooks
from weightsync_audit.ddp.inspect import (
    TrainableChange,
    covered_flags,
    ddp_settings,
    flags_change,
    trainable_flags,
    watched_parameters,
)
from weightsync_audit.engine.explain.evidence import mark_retired, remember_flags
from weightsync_audit.errors import TrainableSetMismatchError
from weightsync_audit.text import brief_names, fmt_ranks, majority

__all__ = ["agree_trainable", "maybe_rewrap", "reduce_grads_by_hand", "retire", "rewrap_ddp", "rewrap_if_changed"]

log = logging.getLogger("weightsync_audit")

DEFAULT_AGREE_TIMEOUT_S = 300.0
"""How long ranks wait for each other to agree on the trainable set before naming the missing ones."""


def agree_trainable(
    ddp: DistributedDataParallel, flags: tuple[bool, ...], *, timeout_s: float | None = DEFAULT_AGREE_TIMEOUT_S
) -> None:
    """Check, collectively and with a deadline, that every rank of ``ddp``'s group holds ``flags``.

    One fixed-size exchange when they agree. When they do not, every rank raises
    :class:`~weightsync_audit.TrainableSetMismatchError` naming the parameters and the ranks, the same
    on every rank; a rank that does not arrive makes the others raise ``AuditTimeoutError``.
    Without an initialised process group it does nothing.
    """
    comm = Comm(ddp.process_group, timeout_s)
    if not comm.distributed:
        return
    digest = xxhash.xxh3_64_intdigest(bytes(np.packbits(np.array(flags, dtype=bool)))) >> 1
    table = comm.exchange(np.array([digest, len(flags)], dtype=np.int64), "the trainable-set check")
    if (table == table[0]).all():
        return
    names = [n for n, _ in ddp.module.named_parameters()]
    blobs = comm.exchange_bytes(json.dumps([int(f) for f in flags]).encode(), "the trainable sets")
    per_rank = [json.loads(b) for b in blobs]
    ranks = comm.global_ranks
    lines = []
    for i, name in enumerate(names):
        column = [row[i] if i < len(row) else None for row in per_rank]
        _, odd = majority(column)
        if odd:
            state = "trainable" if column[odd[0]] else "frozen"
            lines.append(f"{name} is {state} on {fmt_ranks([ranks[r] for r in odd])} only")
    _, odd_rows = majority([tuple(row) for row in per_rank])
    differing = [ranks[r] for r in odd_rows]
    raise TrainableSetMismatchError(
        "weightsync: ranks disagree on which parameters are trainable, so DistributedDataParallel cannot be "
        f"re-wrapped consistently ({brief_names(lines, 6) or 'the parameter counts differ'}); freeze and "
        "unfreeze the same parameters on every rank at the same step",
        differing,
    )


def _register_hooks(ddp: DistributedDataParallel, hooks: list[tuple[Callable[..., Any], object]]) -> None:
    for hook, state in hooks:
        ddp.register_comm_hook(state, hook)


def retire(ddp: DistributedDataParallel) -> None:
    """Detach an outgoing wrapper's reducer from the parameters, so it reduces nothing any more.

    The wrapper is marked retired, so whatever still holds it (an ``Auditor``) reads the wrapper that
    replaced it (:func:`~weightsync_audit.engine.explain.evidence.live_ddp`), never this one.
    """
    remove_ddp_autograd_hooks(ddp)
    mark_retired(ddp)


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
    hooks = ddp_comm_hooks(ddp)
    retire(ddp)
    with torch.no_grad(), warnings.catch_warnings():
        # broadcast_buffers=False is deprecated in torch 2.13, but it is the only spelling that keeps
        # rank-local buffers as they are at construction.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        new = build(ddp.module) if build is not None else DistributedDataParallel(ddp.module, **settings)
    if not ddp_comm_hooks(new):  # a factory may register its own; DDP accepts one hook only
        _register_hooks(new, hooks)
    remember_flags(new, trainable_flags(new.module))
    mark_retired(ddp, new)
    return new


def maybe_rewrap(
    ddp: DistributedDataParallel,
    *,
    reduce_pending: bool = False,
    agree: bool = True,
    timeout_s: float | None = DEFAULT_AGREE_TIMEOUT_S,
) -> DistributedDataParallel:
    """``ddp`` itself while its reducer covers the trainable set; otherwise a re-wrapped one.

    For plain training loops: call it on every rank where the trainable set may have changed (after
    unfreezing or freezing, or simply before every forward) and use what it returns::

        for batch in loader:
            ddp = maybe_rewrap(ddp)
            loss = ddp(batch).sum(); loss.backward(); opt.step(); opt.zero_grad()

    Cost when nothing changed: one tuple of ``requires_grad`` flags compared; a change is logged at INFO.
    ``reduce_pending=True`` between ``backward()`` and ``optimizer.step()``: the gradients the old reducer
    missed this step are averaged by hand first (:func:`reduce_grads_by_hand`). ``agree`` (default on): the
    ranks first check together, within ``timeout_s``, that they hold the same trainable set
    (:func:`agree_trainable`); docs/lightning-20340.md.
    """
    new, change, _ = rewrap_if_changed(ddp, covered_flags(ddp), reduce_pending=reduce_pending, agree=agree,
                                       timeout_s=timeout_s)  # fmt: skip
    if new is None:
        return ddp
    log.info("weightsync: re-wrapped DistributedDataParallel, trainable set changed (%s)", change.describe())
    return new


def rewrap_if_changed(
    ddp: DistributedDataParallel,
    covered: tuple[bool, ...],
    *,
    reduce_pending: bool,
    agree: bool = True,
    timeout_s: float | None = DEFAULT_AGREE_TIMEOUT_S,
    build: Callable[[nn.Module], DistributedDataParallel] | None = None,
) -> tuple[DistributedDataParallel | None, TrainableChange, list[str]]:
    """The check :func:`maybe_rewrap` and the Lightning callback share: ``(the new wrapper, or None while the
    trainable set is ``covered``; the change; the gradients averaged by hand with ``reduce_pending``)``."""
    now = trainable_flags(watched_parameters(ddp))
    if agree:
        agree_trainable(ddp, now, timeout_s=timeout_s)
    if now == covered:
        return None, TrainableChange((), ()), []
    change = flags_change(ddp.module, covered, now)
    reduced = reduce_grads_by_hand(ddp, change, covered) if reduce_pending else []
    return rewrap_ddp(ddp, build=build), change, reduced


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
