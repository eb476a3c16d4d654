"""The logic of the ``DDPRewrapOnTrainableChange`` callback, shared by both Lightning namespaces.

Lightning's DDP strategy wraps the model once, in ``strategy.setup``; DDP builds its gradient reducer
then, over the parameters that require grad at that moment. ``BackboneFinetuning`` (and any manual
freezing) changes that set later, and the reducer never learns of it (Lightning #20340). This mixin
re-creates the wrapper, the way the strategy built it, whenever the set changes. It imports nothing
from Lightning; ``pytorch_lightning`` and ``lightning.pytorch`` each get a class over it.

Where it checks, and why there:

- ``on_fit_start``: the reducer was built a moment ago, but ``configure_optimizers`` and setup hooks
  ran in between; the reducer is read once to be sure.
- ``on_train_epoch_start`` and ``on_train_batch_start``: ``BackboneFinetuning`` unfreezes in
  ``on_train_epoch_start``; whatever the callback order, every epoch-start hook has run by the first
  ``on_train_batch_start``, before this step's forward. ``strategy.model`` is read on every step, so
  the new wrapper serves this very step.
- ``on_after_backward``: a change made after this callback's batch-start check (a later callback's
  or the LightningModule's ``on_train_batch_start``) has already run one backward under the stale
  reducer; the gradients it missed are averaged by hand, then the wrapper is re-created, all before
  ``on_before_optimizer_step`` (so ``WeightSyncAudit``'s trainable-set warning does not fire).

The no-change path is one tuple of ``requires_grad`` flags compared with the snapshot. The decision
to re-wrap is taken on every rank from its own flags: freezing must happen on every rank alike (as it
does with ``BackboneFinetuning``), and the new wrapper verifies that it did.
"""

from __future__ import annotations

import logging
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from weightsync_audit.compat import lightning_ddp_factory, lightning_reset_static_graph
from weightsync_audit.ddp.inspect import TrainableChange, covered_flags
from weightsync_audit.ddp.rewrap import DEFAULT_AGREE_TIMEOUT_S, rewrap_if_changed
from weightsync_audit.engine.explain.evidence import find_ddp
from weightsync_audit.integrations.lightning.audit_callback import route_hooks

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger("weightsync_audit")


@dataclass(frozen=True)
class RewrapEvent:
    """One re-wrap: when, from which hook, and which parameters joined or left the trainable set."""

    epoch: int
    step: int
    hook: str
    joined: tuple[str, ...]
    left: tuple[str, ...]
    reduced_by_hand: tuple[str, ...] = ()
    """Gradients averaged by hand because one backward already ran under the stale reducer."""

    def describe(self) -> str:
        text = (
            f"weightsync: re-wrapped DistributedDataParallel at epoch {self.epoch}, step {self.step} "
            f"({self.hook}): the trainable set changed ({TrainableChange(self.joined, self.left).describe()})"
        )
        if self.reduced_by_hand:
            text += f"; averaged {len(self.reduced_by_hand)} gradient(s) of this step by hand"
        return text


class DDPRewrapMixin:
    """Re-create the DDP wrapper, with the strategy's own settings and the old wrapper's comm hooks, whenever
    the set of trainable parameters changes (the module's docstring says where it checks, and why there).

    Its place in the callback list does not matter; with ``ddp``, ``ddp_spawn`` and ``ddp_fork``; nothing
    without a DDP wrapper. The optimizer is left alone: it holds the same parameters.

    Args:
        verbose: print each re-wrap on rank zero (it is also logged at INFO on ``weightsync_audit``).

    Attributes:
        rewraps: the :class:`RewrapEvent` of every re-wrap in this process, oldest first.

    Example::

        trainer = pl.Trainer(strategy="ddp", devices=2, callbacks=[
            BackboneFinetuning(unfreeze_backbone_at_epoch=3), DDPRewrapOnTrainableChange()])
    """

    def __init__(self, verbose: bool = True, timeout_s: float | None = DEFAULT_AGREE_TIMEOUT_S) -> None:
        super().__init__()
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0
        ):
            raise ValueError(f"timeout_s={timeout_s!r}: must be a positive number of seconds, or None")
        self.verbose = verbose
        self.timeout_s = timeout_s
        """Deadline for the ranks to agree on the trainable set at each check."""
        self.rewraps: list[RewrapEvent] = []
        # Not picklable state stays None until fit starts inside the worker (ddp_spawn pickles callbacks).
        self._ddp_ref: weakref.ReferenceType[DistributedDataParallel] | None = None
        self._flags: tuple[bool, ...] | None = None
        self._warned_nested = False

    # -- hooks ---------------------------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ddp_ref, self._flags = None, None
        self._check(trainer, "on_fit_start")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer, "on_after_backward", mid_step=True)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._ddp_ref, self._flags = None, None

    # -- the check -----------------------------------------------------------------------------

    def _current(self, trainer: Any) -> DistributedDataParallel | None:
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            return model
        if not self._warned_nested and find_ddp(model) is not None:
            # A wrapper inside another wrapper cannot be swapped through strategy.model.
            self._warned_nested = True
            log.warning("weightsync: DistributedDataParallel is nested in %s; not re-wrapping it", type(model).__name__)
        return None

    def _check(self, trainer: Any, hook: str, mid_step: bool = False) -> None:
        ddp = self._current(trainer)
        if ddp is None:
            return
        if self._ddp_ref is None or self._ddp_ref() is not ddp:
            # First sight of this wrapper (fit start, or someone else re-wrapped): learn what its
            # reducer covers, once; a wrapper this module built carries its flags already.
            self._ddp_ref = weakref.ref(ddp)
            self._flags = covered_flags(ddp)
        # A re-wrap is collective: every rank checks, with a deadline, that all hold the same flags. This
        # step's backward ran under the stale reducer (outside no_sync) when mid-step: its job is finished.
        assert self._flags is not None
        new, change, reduced = rewrap_if_changed(
            ddp, self._flags, reduce_pending=mid_step and ddp.require_backward_grad_sync, timeout_s=self.timeout_s,
            build=lightning_ddp_factory(trainer.strategy),
        )  # fmt: skip
        if new is None:
            return
        self._swap(trainer, new)
        event = RewrapEvent(
            epoch=int(trainer.current_epoch),
            step=int(trainer.global_step),
            hook=hook,
            joined=change.joined,
            left=change.left,
            reduced_by_hand=tuple(reduced),
        )
        self.rewraps.append(event)
        if trainer.is_global_zero:
            if self.verbose and not log.isEnabledFor(logging.INFO):
                print(event.describe(), file=sys.stderr, flush=True)  # logging would not show it
            log.info("%s", event.describe())

    def _swap(self, trainer: Any, new: DistributedDataParallel) -> None:
        # The strategy's own factory kept its DDP kwargs, device ids and CUDA stream; rewrap_ddp replayed the
        # old wrapper's comm hooks (the strategy's and any the user registered).
        trainer.strategy.model = new
        self._ddp_ref = weakref.ref(new)
        self._flags = covered_flags(new)  # recorded by rewrap_ddp at construction
        lightning_reset_static_graph(trainer.strategy)  # its one-time static-graph flush is per wrapper


route_hooks(DDPRewrapMixin, ("on_train_epoch_start", "on_train_batch_start"), to="_check")
