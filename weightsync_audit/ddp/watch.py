"""Watching DDP's trainable set during training: warn once, before any weight moves, when the set of
trainable parameters leaves the reducer behind (Lightning #20340).

Framework-free, so every Trainer adapter uses the same watch: call :meth:`TrainableSetWatch.snapshot` right
after the wrap and :meth:`TrainableSetWatch.check` before each optimizer step.

>>> import torch
>>> TrainableSetWatch().check(torch.nn.Linear(2, 2), step=0)  # not wrapped by DDP: nothing to watch
False
"""

from __future__ import annotations

import warnings
from typing import Any

from weightsync_audit.ddp.inspect import covered_flags, flags_change, trainable_flags, watched_parameters
from weightsync_audit.engine.explain.evidence import ddp_frozen_hint, ddp_unsynced_hint
from weightsync_audit.engine.inventory.reducer import find_ddp, fix_for
from weightsync_audit.errors import WeightSyncWarning, user_stacklevel

__all__ = ["TrainableSetWatch"]


class TrainableSetWatch:
    """Remembers what DDP's reducer covers and warns once when the trainable set moves away from it."""

    def __init__(self) -> None:
        self.warned = False
        self.said: list[str] = []
        """The hints the warning gave (a report that follows refers to them instead of repeating them)."""
        self._flags_seen: tuple[bool, ...] = ()

    def snapshot(self, model: Any) -> None:
        """Right after the wrap: what the reducer covers, remembered on the wrapper itself, so that a new
        wrapper (a re-wrap) is recognised by not carrying it yet."""
        ddp = find_ddp(model)
        if ddp is not None:
            covered_flags(ddp)

    def check(self, model: Any, step: int, *, warn: bool = True) -> bool:
        """Whether the trainable set left DDP's reducer behind (warned about once; ``warn`` on one rank)."""
        if self.warned:
            return False
        ddp = find_ddp(model)
        if ddp is None:
            return False
        covered = covered_flags(ddp)
        now = trainable_flags(watched_parameters(ddp))
        if now == covered or now == self._flags_seen:
            return False
        self._flags_seen = now
        change = flags_change(ddp.module, covered, now)
        parts = []
        if change.joined:
            parts.append(ddp_unsynced_hint(list(change.joined), fix=fix_for(ddp)))
        if change.left and not ddp.find_unused_parameters:
            parts.append(ddp_frozen_hint(list(change.left), fix=fix_for(ddp)))
        if not parts:
            return False
        self.warned = True
        if warn:
            self.said = parts
            warnings.warn(
                f"weightsync audit (step {step}): the set of trainable parameters changed after "
                "DistributedDataParallel wrapped the model. " + " ".join(parts),
                WeightSyncWarning,
                stacklevel=user_stacklevel(),
            )
        return True
