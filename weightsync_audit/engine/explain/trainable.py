"""The proven hints for a trainable set changed after the DDP wrap (Lightning #20340), and their fix.

DDP builds its gradient reducer once, over the parameters that require grad then: a parameter unfrozen
later is stepped from local gradients on each rank, one frozen later stalls the bucket that holds it. The
rules of :mod:`~weightsync_audit.engine.explain.rules` state these as fact when the wrapper proves them,
and the trainable-set watch (:mod:`weightsync_audit.ddp.watch`) words the change the same way when it
sees it happen, before any replica differs.
"""

from __future__ import annotations

from typing import Sequence

from weightsync_audit.text import brief_names

__all__ = ["ddp_frozen_hint", "ddp_unsynced_hint"]

_FIX = (
    "Fix: re-create the DDP wrapper whenever the trainable set changes: add "
    "weightsync_audit.DDPRewrapOnTrainableChange() to the Trainer's callbacks, or, in a plain loop, "
    "ddp = weightsync_audit.maybe_rewrap(ddp) (or rewrap_ddp(ddp)) on every rank after unfreezing or freezing."
)


def _resync_too(state: Sequence[str]) -> str:
    """The second half of the fix once replicas drifted, naming only optimizer state that exists."""
    stepped = (
        f"their {', '.join(state)} were stepped from local gradients too and bring"
        if state
        else "any state the optimizer keeps per parameter was stepped from local gradients too and brings"
    )
    return (
        " Re-wrapping stops new drift but does not undo what already differs: resync it once, optimizer state "
        f"included ({stepped} the drift back a few steps later): WeightSyncAudit(on_mismatch='resync'), or "
        "weightsync_audit.resync(model, optimizer, src='majority') on every rank right after the re-wrap."
    )


def ddp_unsynced_hint(
    unsynced: Sequence[str], *, drifted: bool = False, state: Sequence[str] = (), fix: str | None = None
) -> str:
    """The proven cause of Lightning #20340: trainable parameters outside DDP's reducer.

    ``drifted``: the replicas already differ, so the fix must also resync them, optimizer state included;
    ``state``: the optimizer state keys those parameters have (``exp_avg``...), named in that advice.
    ``fix``: the fix to offer instead of the re-wrap (a Trainer whose loop keeps its own wrapper), whole.

    >>> "Adam" in ddp_unsynced_hint(["fc.weight"], drifted=True)  # no optimizer named that is not known
    False
    """
    return (
        f"{brief_names(unsynced)} require grad, but DistributedDataParallel does not all-reduce their "
        "gradients: they became trainable after DDP wrapped the model (DDP builds its gradient reducer "
        "once, over the parameters that required grad then; BackboneFinetuning's unfreeze is one way), so "
        "each rank steps them with its own local gradient. "
        + (fix if fix is not None else _FIX + (_resync_too(state) if drifted else ""))
    )


def ddp_frozen_hint(left: Sequence[str], *, fix: str | None = None) -> str:
    """Parameters frozen after the wrap: DDP's reducer still waits for their gradients."""
    return (
        f"{brief_names(left)} were frozen after DistributedDataParallel wrapped the model; its reducer still "
        "expects their gradients, so the bucket holding them is never all-reduced (without "
        "find_unused_parameters=True the next forward fails with 'Expected to have finished reduction "
        f"in the prior iteration'). {_FIX if fix is None else fix}"
    )
