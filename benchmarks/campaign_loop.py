"""The combination campaign's plain loop: a DDP training loop audited by :class:`~weightsync_audit.LoopAudit`.

The loop holds every training pattern of the campaign (:data:`campaign_cover.FACTORS`): gradient accumulation
with ``DDP.no_sync``, fp16 autocast with a ``GradScaler``, clipping, an lr scheduler, an EMA of the weights
kept as buffers, a WGAN-style clamp after the step (after the audit call: inside an overlapped audit's
window), a frozen embedding, two param groups, and LBFGS stepped with a closure.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any, Callable

import torch
from campaign_case import (
    CLAMP,
    EVERY,
    STEPS,
    Case,
    Faults,
    Net,
    averaged,
    batches,
    build_optimizer,
    build_scheduler,
    freeze,
)
from campaign_truth import Capture
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

TIMEOUT_S = 30.0
"""The audit's own deadline (``timeout_s``): a rank missing from an audit makes the others raise in time."""


def ended(exc: BaseException) -> dict[str, Any]:
    """How a run ended by ``exc``: a divergence raised as asked (``raise``), or a crash."""
    from weightsync_audit import WeightDivergenceError

    if isinstance(exc, WeightDivergenceError):
        return {"raised": True}
    import traceback

    return {"error": f"{type(exc).__name__}: {str(exc)[:600]}", "trace": traceback.format_exc()[-3000:]}


def construct(build: Callable[[], Any]) -> tuple[Any, dict[str, Any] | None]:
    """The adapter ``build()`` makes, or the refusal it raised at construction (the campaign's own column)."""
    try:
        return build(), None
    except Exception as exc:  # noqa: BLE001 - a refusal: its words are the point
        return None, {"refused": f"{type(exc).__name__}: {exc}"}


def finish(
    train: Callable[[], None], cap: Capture, faults: Faults, handles: Callable[[], list[Any]], close: Any = None
) -> dict[str, Any]:
    """Run ``train``; how it ended (raised as asked, or a crash) and the steps the faults were planted at.
    The capture's and the faults' hooks come off whatever happens; ``close`` ends the adapter after an error."""
    out: dict[str, Any] = {}
    try:
        train()
    except Exception as exc:  # noqa: BLE001 - scored: raised as asked, or a crash
        out.update(ended(exc))
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - the run's own error is the one reported
                pass
    finally:
        cap.detach()
        for h in handles():
            h.remove()
    out["planted"] = faults.planted
    return out


def clamp(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-CLAMP, CLAMP)


def _micro(case: Case, ddp: nn.Module, micro: list[Any], scaler: Any) -> torch.Tensor:
    """Forward and backward over the step's micro-batches, all-reducing on the last one only."""
    total = torch.zeros(())
    for i, (ids, y) in enumerate(micro):
        sync = ddp.no_sync() if i < len(micro) - 1 else nullcontext()
        cast = torch.autocast("cpu", dtype=torch.float16) if scaler is not None else nullcontext()
        with sync:
            with cast:
                loss = nn.functional.mse_loss(ddp(ids).float(), y) / len(micro)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach()
    return total


def _step(case: Case, model: nn.Module, ddp: nn.Module, opt: Any, micro: list[Any], scaler: Any) -> None:
    clip = case.pattern == "clip"
    if case.optimizer == "lbfgs":

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = averaged(_micro(case, ddp, micro, None))
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            return loss

        opt.step(closure)
        return
    opt.zero_grad()
    _micro(case, ddp, micro, scaler)
    if scaler is not None:
        if clip:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        return
    if clip:
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()


def run_loop(case: Case, rank: int, world: int, report_path: str) -> tuple[Capture, dict[str, Any]]:
    """One run on this rank: its capture and how it ended (``refused``, ``raised``, ``error``, ``planted``)."""
    from weightsync_audit import LoopAudit

    model = Net(case.seed, ema=case.pattern == "ema")
    freeze(case, model)
    with warnings.catch_warnings():  # broadcast_buffers is deprecated, and still the way to keep buffers local
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DDP(model, broadcast_buffers=False)
    opt = build_optimizer(case, model)
    sched = build_scheduler(case, opt)
    faults = Faults(case, rank, model)
    handles = faults.attach(opt)
    cap = Capture(model, opt)
    cap.attach(opt, lambda: faults.step)
    data = batches(case, rank, STEPS, 2 if case.pattern == "accumulate" else 1)
    scaler = torch.amp.GradScaler("cpu") if case.pattern == "scaler" else None
    audit, refused = construct(
        lambda: LoopAudit(
            ddp, opt, every_n_steps=EVERY, verbose=False, report_path=report_path, timeout_s=TIMEOUT_S, **case.options()
        )
    )
    if refused is not None:
        cap.detach()
        for h in handles:
            h.remove()
        return cap, refused

    def train() -> None:
        for step in range(1, STEPS + 1):
            faults.at_start(step)
            micro = data[step - 1]
            if case.check_batches:
                cap.batch(step, [ids for ids, _ in micro])
            _step(case, model, ddp, opt, micro, scaler)
            if sched is not None:
                sched.step()
            if case.pattern == "ema":
                model.update_ema()
            cap.snap("E", step)
            audit.step(step, batch=micro if case.check_batches else None)
            cap.snap("X", step)
            if case.pattern == "clamp":
                clamp(model)
        audit.close()

    out = finish(train, cap, faults, lambda: handles, close=audit.close)
    return cap, out
