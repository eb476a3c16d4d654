"""A step that changed nothing: with ``pinpoint=True`` each optimizer step's digest is at hand, so a rank
whose audited tensors are bit for bit the same after a step as before it, while its learning rate is not
zero, is told so (a model frozen by mistake: ``requires_grad`` off, gradients zeroed after backward, an
optimizer over other parameters). Local to the rank, a warning only: no message, nothing collective.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from weightsync_audit.errors import WeightSyncWarning, user_stacklevel

__all__ = ["StallWatch"]


def _largest_lr(optimizers: Sequence[Any]) -> float:
    lrs = [g.get("lr", 0.0) for opt in optimizers for g in getattr(opt, "param_groups", ())]
    values = [float(x) for x in lrs if isinstance(x, (int, float)) or hasattr(x, "item")]
    return max(values, default=0.0)


class StallWatch:
    """Compares each step's digest with the previous step's; warns once per stretch of unchanged steps."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.previous: tuple[int, int] | None = None
        self.warned = False

    def check(self, step: int, digest: int | None, optimizers: Sequence[Any]) -> str | None:
        """The warning given for ``step`` (``None`` when the weights moved, lr is zero, or already said)."""
        if digest is None:
            self.previous = None
            return None
        previous, self.previous = self.previous, (step, digest)
        if previous is None or step <= previous[0] or previous[1] != digest:
            self.warned = False
            return None
        lr = _largest_lr(optimizers)
        if self.warned or lr <= 0:
            return None
        self.warned = True
        text = (
            f"weightsync: on rank {self.rank} nothing audited changed over optimizer step {step} although lr={lr:g}: "
            "a model frozen by mistake? (requires_grad off, gradients zeroed after backward, an optimizer over "
            "other parameters)"
        )
        warnings.warn(text, WeightSyncWarning, stacklevel=user_stacklevel())  # the user's loop, not ours
        return text
