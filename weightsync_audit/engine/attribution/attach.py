"""The watch set on a training run: :func:`attach_watch` (the callbacks and ``LoopAudit`` call it once)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from weightsync_audit.engine.attribution.watch import StepWatch
from weightsync_audit.engine.inventory.manifest import as_optimizers
from weightsync_audit.engine.inventory.reducer import find_ddp

__all__ = ["attach_watch", "mark_step", "param_names", "watch_run"]

_WRAPPERS = ("module.", "_forward_module.", "_orig_mod.")


def param_names(model: Any) -> dict[int, str]:
    """id(parameter) -> its name without the wrappers' prefixes (``module.`` of DDP, Lightning's, compile's)."""
    if not isinstance(model, torch.nn.Module):
        return {}
    out = {}
    for name, p in model.named_parameters():
        while name.startswith(_WRAPPERS):
            name = name.split(".", 1)[1]
        out.setdefault(id(p), name)
    return out


def attach_watch(
    auditor: Any,
    model: Any,
    optimizers: Sequence[Any],
    *,
    hook: Callable[..., Any] | None = None,
    state: Any = None,
    offload: bool = False,
) -> StepWatch:
    """A :class:`StepWatch` over ``auditor``'s own manifest of ``model`` and ``optimizers``, its hooks set
    (with ``collective``, DDP's comm hook: ``hook``/``state`` are one the user's DDP already runs).
    ``offload``: the at-rest reads on a worker thread, off the training thread (what ``overlap=True`` sets;
    :mod:`~weightsync_audit.engine.attribution.offload`)."""
    cfg = auditor.config
    opts = as_optimizers(optimizers)
    ddp = find_ddp(model) if model is not None else None
    watch = StepWatch(
        cfg.attribution,
        prepare=lambda: auditor.prepare(model, opts, ddp=ddp),
        optimizers=opts,
        names=param_names(model),
        capacity=cfg.pinpoint_ring,
        method=cfg.method,
        offload=offload,
    )
    watch.attach(ddp, hook, state)
    return watch


def watch_run(runner: Any, model: Any, optimizers: Sequence[Any]) -> None:
    """For an open :class:`~weightsync_audit.integrations.session.runner.AuditRunner` whose options ask for
    ``attribution``: set the watch on its main auditor (once, local); with ``overlap``, its at-rest reads
    off the training thread too."""
    auditor = runner.auditor
    if auditor is not None and auditor.config.attribution is not None and auditor.attribution is None:
        offload = getattr(runner, "overlap", None) is not None
        auditor.attribution = attach_watch(auditor, model, optimizers, offload=offload)


def mark_step(runner: Any, step: int) -> None:
    """After every optimizer step: the watch's record of it closed under ``step`` (local, no message)."""
    watch = getattr(runner.auditor, "attribution", None)
    if watch is not None:
        watch.mark(step)
