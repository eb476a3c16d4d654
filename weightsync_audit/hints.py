"""Why replicas differ: root-cause hints drawn from the mismatches and the wrapper.

A hint states a cause as fact only when the wrapper proves it (DDP's reducer does not cover the
diverged parameters); everything inferred from the pattern of mismatches says "likely".
"""

from __future__ import annotations

from typing import Sequence

from torch.nn.parallel import DistributedDataParallel

from weightsync_audit.ddp import synced_parameter_names, trainable_names
from weightsync_audit.result import Mismatch

__all__ = ["explain", "ddp_unsynced_hint"]

_FIX = (
    "Fix: re-create the DDP wrapper whenever the trainable set changes: add "
    "weightsync_audit.DDPRewrapOnTrainableChange() to the Trainer's callbacks, or call "
    "weightsync_audit.rewrap_ddp(ddp) after unfreezing in a plain loop."
)


def _names(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def ddp_unsynced_hint(unsynced: Sequence[str]) -> str:
    return (
        f"{_names(list(unsynced))} require grad, but DistributedDataParallel does not all-reduce their "
        "gradients: they became trainable after DDP wrapped the model (DDP builds its gradient reducer "
        "once, over the parameters that required grad then), so each rank steps them with its own "
        f"local gradient. {_FIX}"
    )


def explain(
    mismatches: Sequence[Mismatch],
    *,
    ddp: DistributedDataParallel | None = None,
    synced: frozenset[str] | None = None,
    grads_checked: bool = False,
) -> list[str]:
    """Hints for a set of mismatches, most specific first.

    ``synced``: the parameter names DDP all-reduces when the caller already knows them (for example
    a snapshot taken right after the wrap); otherwise they are read from ``ddp``'s reducer.
    """
    if not mismatches:
        return []
    hints: list[str] = []
    by_kind: dict[str, list[Mismatch]] = {}
    for m in mismatches:
        by_kind.setdefault(m.kind, []).append(m)
    params = [m.name for m in by_kind.get("param", [])]
    explained: set[str] = set()

    if params and ddp is not None:
        try:
            covered = synced if synced is not None else synced_parameter_names(ddp)
            trainable = trainable_names(ddp.module)
        except Exception:  # noqa: BLE001 - private reducer API; no hint rather than a crash
            covered, trainable = None, frozenset()
        if covered is not None:
            unsynced = [n for n in params if n in trainable and n not in covered]
            if unsynced:
                hints.append(ddp_unsynced_hint(unsynced))
                explained.update(unsynced)

    if "structure" in by_kind:
        hints.append(
            "The model or optimizer differs in structure between ranks (a tensor missing, or another shape "
            "or dtype): likely the ranks built different models (per-rank configuration), or a checkpoint "
            "or optimizer state was loaded on some ranks only."
        )

    if "buffer" in by_kind:
        names = [m.name for m in by_kind["buffer"]]
        if ddp is not None and not getattr(ddp, "broadcast_buffers", True):
            hints.append(
                f"Buffers {_names(names)} differ and DistributedDataParallel runs with "
                "broadcast_buffers=False, so each rank's own batches update them (BatchNorm running "
                "statistics, most likely). Use broadcast_buffers=True or SyncBatchNorm if they should agree; "
                "exclude them if per-rank statistics are intended."
            )
        else:
            hints.append(
                f"Buffers {_names(names)} differ: likely statistics updated from each rank's local data "
                "(BatchNorm running stats without buffer broadcast or SyncBatchNorm, an EMA or target network "
                "updated locally), or a buffer set differently per rank."
            )

    opt = by_kind.get("optimizer", [])
    if opt and not params:
        lrs = [m.name for m in opt if m.name.rsplit(".", 1)[-1] in ("lr", "initial_lr")]
        if lrs:
            hints.append(
                f"The learning rate differs ({_names(lrs)}) while the parameters still agree: likely a "
                "scheduler stepped a different number of times on some ranks, or was built per rank. The "
                "parameters will diverge at the next optimizer step."
            )
        if len(lrs) < len(opt):
            hints.append(
                "Optimizer state differs while the parameters still agree: likely the optimizer state was "
                "loaded or reset on some ranks only (a checkpoint loaded on one rank), or a step was skipped "
                "on some ranks (e.g. a GradScaler that saw inf on one rank only). The parameters will "
                "diverge at the next optimizer step."
            )

    grads = by_kind.get("grad", [])
    if grads_checked and params and not grads:
        rest = [n for n in params if n not in explained]
        if rest:
            hints.append(
                f"Gradients agree but parameters differ ({_names(rest)}): likely the parameters were already "
                "different before this step (loaded or initialised on some ranks only) or the optimizer "
                "step differs (its state or learning rate)."
            )
    elif grads:
        hints.append(
            f"Gradients differ ({_names([m.name for m in grads])}) at the optimizer step: likely they are not "
            "all-reduced (parameters frozen when DDP wrapped the model, no_sync() without a final synced "
            "backward, or a manual reduction that skips them)."
        )

    rest = [n for n in params if n not in explained]
    if rest and not grads and not (grads_checked and params):
        hints.append(
            f"Parameters {_names(rest)} differ: likely their gradients are not all-reduced (trainable set "
            "changed after the DDP wrap, no_sync() misuse, a custom loop without DDP), they were loaded or "
            "initialised on some ranks only, or non-deterministic updates (EMA from local data)."
        )
    return hints
