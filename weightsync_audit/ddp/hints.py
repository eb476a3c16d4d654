"""Why replicas differ: root-cause hints drawn from the mismatches and the wrapper.

A hint states a cause as fact only when the wrapper proves it (DDP's reducer does not cover the
diverged parameters, or DDP was told to ignore them, or runs with ``forward_sync_buffers=False``,
formerly ``broadcast_buffers=False``); everything inferred from the pattern of mismatches says "likely".
Hints come most specific first, each mismatch feeds at most one parameter hint, and a cause stays named
while its mismatches remain (an optimizer cause is not dropped once the parameters follow it). The
wrapper read is the live one: a wrapper a re-wrap retired is followed to its successor, or not read.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from weightsync_audit.ddp.inspect import live_ddp, remembered_flags, synced_parameter_names, syncs_buffers
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import brief_names

__all__ = ["ddp_frozen_hint", "ddp_unsynced_hint", "explain", "uses_fsdp2"]

#: Name parts that mark an averaged copy of the weights (EMA, Polyak, target networks).
_EMA_MARKS = ("ema", "ewm", "shadow", "average", "averaged", "swa", "polyak", "target", "momentum_encoder")

_FIX = (
    "Fix: re-create the DDP wrapper whenever the trainable set changes: add "
    "weightsync_audit.DDPRewrapOnTrainableChange() to the Trainer's callbacks, or, in a plain loop, "
    "ddp = weightsync_audit.maybe_rewrap(ddp) (or rewrap_ddp(ddp)) on every rank after unfreezing or freezing."
)


_RESYNC_TOO = (
    " Re-wrapping stops new drift but does not undo what already differs: resync it once, optimizer state "
    "included (the Adam moments stepped from local gradients differ too, and bring the drift back a few "
    "steps later): WeightSyncAudit(on_mismatch='resync'), or weightsync_audit.resync(model, optimizer, "
    "src='majority') on every rank right after the re-wrap."
)


def ddp_unsynced_hint(unsynced: Sequence[str], *, drifted: bool = False) -> str:
    """The proven cause of Lightning #20340: trainable parameters outside DDP's reducer.

    ``drifted``: the replicas already differ, so the fix must also resync them, optimizer state included.
    """
    return (
        f"{brief_names(unsynced)} require grad, but DistributedDataParallel does not all-reduce their "
        "gradients: they became trainable after DDP wrapped the model (DDP builds its gradient reducer "
        "once, over the parameters that required grad then; BackboneFinetuning's unfreeze is one way), so "
        f"each rank steps them with its own local gradient. {_FIX}" + (_RESYNC_TOO if drifted else "")
    )


def _looks_averaged(name: str) -> bool:
    parts = name.lower().replace("-", "_").split(".")
    return any(p in _EMA_MARKS or p.startswith(("ema_", "ewm_")) or p.endswith("_ema") for p in parts)


def ddp_frozen_hint(left: Sequence[str]) -> str:
    """Parameters frozen after the wrap: DDP's reducer still waits for their gradients."""
    return (
        f"{brief_names(left)} were frozen after DistributedDataParallel wrapped the model; its reducer still "
        "expects their gradients, so the bucket holding them is never all-reduced (without "
        "find_unused_parameters=True the next forward fails with 'Expected to have finished reduction "
        f"in the prior iteration'). {_FIX}"
    )


def _covered(ddp: DistributedDataParallel, synced: frozenset[str] | None) -> frozenset[str] | None:
    """Names DDP all-reduces: given, remembered by a re-wrap, or read from the reducer (rare path)."""
    if synced is not None:
        return synced
    try:
        flags = remembered_flags(ddp)
        if flags is not None:
            return frozenset(n for (n, _), f in zip(ddp.module.named_parameters(), flags) if f)
        return synced_parameter_names(ddp)
    except Exception:  # noqa: BLE001 - private reducer API; no hint rather than a crash
        return None


def uses_fsdp2(module: Any) -> bool:
    """Whether ``module`` (or a module inside it) is sharded by FSDP2's ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule  # lazy: the fsdp package costs ~0.3 s at import

    return isinstance(module, nn.Module) and any(isinstance(m, FSDPModule) for m in module.modules())


def explain(
    mismatches: Sequence[Mismatch],
    *,
    ddp: DistributedDataParallel | None = None,
    synced: frozenset[str] | None = None,
    grads_checked: bool = False,
    params_compared: bool = True,
    module: Any = None,
    drifting: Collection[str] = (),
    drift_hint: Callable[[list[str]], str] | None = None,
) -> list[str]:
    """Hints for a set of mismatches, most specific first.

    ``synced``: the parameter names DDP all-reduces when the caller already knows them (for example
    a snapshot taken right after the wrap); otherwise they are read from ``ddp``.
    ``grads_checked``: gradients were part of this audit, so "no grad mismatch" means they agree.
    ``params_compared``: at least one parameter was compared (not so when every shard has no replica),
    so "no param mismatch" means they agree. ``module``: the audited module, to recognise FSDP2.
    ``drifting``: names whose measured gap is the size of float rounding; unless a proven cause above
    accounts for them, ``drift_hint(names)`` explains them instead of the bug-class guesses below.
    """
    if not mismatches:
        return []
    ddp = live_ddp(ddp)  # a retired wrapper proves nothing about the reduction that runs now
    hints: list[str] = []
    by_kind: dict[str, list[Mismatch]] = {}
    for m in mismatches:
        by_kind.setdefault(m.kind, []).append(m)
    params = [m.name for m in by_kind.get("param", [])]
    grads = [m.name for m in by_kind.get("grad", [])]
    explained: set[str] = set()  # parameter (or gradient) names a proven cause accounts for

    if (params or grads) and ddp is not None:
        covered = _covered(ddp, synced)
        named = dict(ddp.module.named_parameters())
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        if covered is not None:
            diverged = list(dict.fromkeys(params + grads))  # a param and its grad name alike
            unsynced = [
                n for n in diverged if n in named and named[n].requires_grad and n not in covered and n not in ignored
            ]
            if unsynced:
                hints.append(ddp_unsynced_hint(unsynced, drifted=True))
                explained.update(unsynced)
                # Their optimizer state was stepped from local gradients too: the same cause.
                explained.update(
                    m.name for m in by_kind.get("optimizer", []) if m.name.rsplit(".", 1)[0] in set(unsynced)
                )
            # With find_unused_parameters=True the reducer marks a frozen parameter unused at each
            # forward and its bucket completes; only without it does freezing after the wrap hurt.
            left = [n for n, p in named.items() if n in covered and n not in ignored and not p.requires_grad]
            if left and not getattr(ddp, "find_unused_parameters", False):
                hints.append(ddp_frozen_hint(left))
                # Their buckets were never all-reduced: the gradients that share them stayed local.
                explained.update(n for n in diverged if n in covered)
        skipped = [n for n in params + grads if n in ignored and n not in explained]
        if skipped:
            hints.append(
                f"{brief_names(skipped)} are in DistributedDataParallel's parameters_to_ignore "
                "(module._ddp_params_and_buffers_to_ignore): DDP neither broadcasts them nor all-reduces "
                "their gradients, so each rank trains its own copy. Remove them from the list, or reduce "
                "them yourself, if they should agree."
            )
            explained.update(skipped)

    drift = [n for n in dict.fromkeys(drifting) if n not in explained]
    if drift and drift_hint is not None:
        hints.append(drift_hint(drift))
        explained.update(drift)
        gone = set(drift)
        by_kind = {k: kept for k, ms in by_kind.items() if (kept := [m for m in ms if m.name not in gone])}

    sharded = [m.name for m in by_kind.get("param", []) if m.shard and m.name not in explained]
    if sharded:
        hints.append(
            f"Shards of {brief_names(list(dict.fromkeys(sharded)))} differ between ranks that hold the same shard "
            "(replicas across the data-parallel / replicate dimension, or the tensor-parallel peers of a "
            "DP-only weight, which nothing keeps equal): likely non-deterministic kernels on some ranks "
            "(pytorch#160169), per-rank initialisation, or a checkpoint loaded on some ranks only."
        )
        explained.update(sharded)

    if "structure" in by_kind:
        hints.append(
            f"The model or optimizer differs in structure between ranks ({brief_names([m.name for m in by_kind['structure']])}: "
            "a tensor missing, or another shape or dtype): likely the ranks built different models "
            "(per-rank configuration), or a checkpoint or optimizer state was loaded on some ranks only."
        )

    if "buffer" in by_kind:
        names = [m.name for m in by_kind["buffer"]]
        if uses_fsdp2(module):
            hints.append(
                f"Buffers {brief_names(names)} differ under FSDP2 (fully_shard), which never synchronises "
                "buffers: each rank keeps the ones its own batches updated (BatchNorm running statistics, "
                "most likely). Reduce them yourself (e.g. all_reduce the running stats before evaluation or "
                "a checkpoint) if they should agree; exclude them if per-rank statistics are intended."
            )
        elif ddp is not None and not syncs_buffers(ddp):
            hints.append(
                f"Buffers {brief_names(names)} differ and DistributedDataParallel runs with "
                "forward_sync_buffers=False (broadcast_buffers=False before torch 2.13), so each rank's own "
                "batches update them (BatchNorm running statistics, most likely). Use forward_sync_buffers=True "
                "or SyncBatchNorm if they should agree; exclude them if per-rank statistics are intended."
            )
        else:
            hints.append(
                f"Buffers {brief_names(names)} differ: likely statistics updated from each rank's local data "
                "(BatchNorm running stats without buffer sync, i.e. forward_sync_buffers / broadcast_buffers, "
                "or SyncBatchNorm; an EMA or target network updated locally), or a buffer set differently per rank."
            )

    opt = [m for m in by_kind.get("optimizer", []) if m.name not in explained]
    followers = [n for n in params if n not in explained]
    if opt:
        # Named while its mismatches remain: once the parameters follow, they are its consequence.
        if followers:
            state = f" and the parameters have followed ({brief_names(followers)})"
            then = " The differing parameters most likely follow from it."
        elif params_compared:
            state = " while the parameters still agree"
            then = " The parameters will diverge at the next optimizer step."
        else:
            state = " (no parameter could be compared: every parameter shard is held by one rank only)"
            then = " The parameters will diverge at the next optimizer step."
        lrs = [m.name for m in opt if m.name.rsplit(".", 1)[-1] in ("lr", "initial_lr")]
        if lrs:
            hints.append(
                f"The learning rate differs ({brief_names(lrs)}){state}: likely a scheduler stepped a different "
                f"number of times on some ranks, or was built per rank.{then}"
            )
        if len(lrs) < len(opt):
            others = [m.name for m in opt if m.name not in set(lrs)]
            hints.append(
                f"Optimizer state differs ({brief_names(others)}){state}: likely the optimizer state was loaded or "
                "reset on some ranks only (a checkpoint loaded on one rank), or a step was skipped on some "
                f"ranks (e.g. a GradScaler that saw inf on one rank only).{then}"
            )
        explained.update(followers)

    rest_grads = [n for n in grads if n not in explained]
    if rest_grads:
        hints.append(
            f"Gradients differ ({brief_names(rest_grads)}) at the optimizer step: likely they are not "
            "all-reduced (no DistributedDataParallel wrapper, no_sync() without a final synced backward, "
            "or a manual reduction that skips them)."
        )

    rest = [n for n in params if n not in explained]
    averaged = [n for n in rest if _looks_averaged(n)]
    if averaged:
        hints.append(
            f"{brief_names(averaged)} differ and look like an averaged copy of the weights (EMA, SWA or a "
            "target network): likely each rank updates it from its own values (local batches, or before "
            "the gradients are all-reduced), and DDP never syncs it. Update it after optimizer.step() from "
            "the synced parameters, keep it on one rank only, or exclude it if per-rank copies are intended."
        )
        rest = [n for n in rest if n not in set(averaged)]
    if rest and ddp is not None:
        named = dict(ddp.module.named_parameters())
        frozen = [n for n in rest if n in named and not named[n].requires_grad]
        if frozen:
            hints.append(
                f"{brief_names(frozen)} differ but do not require grad, so no optimizer step moved them: likely "
                "they were loaded, initialised or edited on some ranks only after DDP's broadcast at wrap time."
            )
            rest = [n for n in rest if n not in set(frozen)]
    if rest and grads_checked and not grads:
        hints.append(
            f"Gradients agree but parameters differ ({brief_names(rest)}): likely the parameters were already "
            "different before this step (loaded or initialised on some ranks only) or the optimizer "
            "step differs (its state or learning rate)."
        )
    elif rest and not rest_grads:
        hints.append(
            f"Parameters {brief_names(rest)} differ: likely their gradients are not all-reduced (trainable set "
            "changed after the DDP wrap, no_sync() misuse, a custom loop without DDP), they were loaded or "
            "initialised on some ranks only, or non-deterministic updates (EMA from local data)."
        )
    return hints
