"""``WeightSyncAuditCallback``: the weight audit as a Hugging Face ``transformers.TrainerCallback``.

A thin adapter over :class:`~weightsync_audit.integrations.session.runner.AuditRunner` (the same engine and the
same options as the Lightning callback). What is particular to the Trainer:

* callback events receive the *unwrapped* model, so the buffer policy cannot be read from a wrapper: it
  comes from the engine Accelerate runs (:func:`engine_of`): DDP's ``args.ddp_broadcast_buffers``
  (``None`` is DDP's default, on); DeepSpeed and FSDP: buffers compared;
* DeepSpeed (ZeRO 0-3) and FSDP runs are audited, however launched: the replica adapters decide from the
  model and optimizer the events carry what has replicas and what has one owner (docs/sharded.md);
* the optimizer as it stands right before the step is only visible at ``on_pre_optimizer_step``: an
  ``lr`` set differently on one rank is gone again by ``on_step_end`` (the scheduler resets it), so the
  gradient audit there also compares the optimizer;
* ``state.global_step`` counts optimizer steps, so gradient accumulation does not repeat an audit;
* the DDP wrapper the Trainer trains through (``trainer.model_wrapped``) is read from the Trainer that
  dispatches the event (:func:`find_trainer`), so hints read its reducer and a trainable set that moved
  after the wrap is warned about before the step; the Trainer's loop keeps the wrapper it built, so the
  fix offered is :data:`TRAINER_FIX`, not a re-wrap (docs/integrations.md).

Import it as ``from weightsync_audit.transformers import WeightSyncAuditCallback``; this module is the
only one in the package that imports ``transformers``.
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any, Optional, Sequence

from transformers import TrainerCallback
from typing_extensions import override

from weightsync_audit.engine.config import OnMismatch, checked_options
from weightsync_audit.engine.explain.evidence import FIX_ATTR, find_ddp
from weightsync_audit.engine.inventory.manifest import unwrap_module
from weightsync_audit.engine.repair.plan import ResyncSource
from weightsync_audit.integrations.hf.engines import buffer_policy, checkpoint_dir, hf_resume, resumed_folder
from weightsync_audit.integrations.session.options import AuditOptions, check_every_n, with_option_properties
from weightsync_audit.integrations.session.runner import audit_metrics
from weightsync_audit.integrations.session.trainer_session import Checkpoint, SessionAdapter, TrainerSession
from weightsync_audit.reporting.jsonl import RecordSink
from weightsync_audit.reporting.record import AuditResult

__all__ = ["TRAINER_FIX", "WeightSyncAuditCallback", "find_trainer", "trainer_ddp"]

#: The fix offered under the Hugging Face Trainer for a trainable set that changed after its DDP wrap.
#: Its training loop holds the wrapper it built in a local variable, so a re-wrap from a callback would
#: not be used; what works is a reducer built over every parameter that will ever train
#: (tests/test_hf_unfreeze.py proves it on 2 ranks).
TRAINER_FIX = (
    "Fix under the Hugging Face Trainer (its training loop keeps the DDP wrapper it built, so no callback can "
    "re-wrap it): let every parameter that will ever train require grad when trainer.train() starts, freeze "
    "the ones that must wait in a callback's on_train_begin (it runs after the wrap) and pass "
    "TrainingArguments(ddp_find_unused_parameters=True); unfreezing them later is then all-reduced. Replicas "
    "that already differ: resume from a checkpoint saved before they diverged (every rank loads the same weights)."
)


class _LogLead(TrainerCallback):
    """Stands first in the Trainer's callback list, ahead of the ``report_to`` integrations (TensorBoard,
    W&B, MLflow...) that the Trainer lists before user callbacks: its ``on_log`` adds the audit's figures
    to ``logs`` before they write them. Only ``on_log``: every other event keeps the user's order."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.owner.on_log(args, state, control, logs=logs, **kwargs)


def lead_the_log(callback: Any) -> bool:
    """Put a :class:`_LogLead` for ``callback`` at the front of the Trainer's callback list (once). The list
    is the calling ``CallbackHandler``'s public ``callbacks``, found on the stack of the event being
    dispatched; inserting at the front leaves the rest of that dispatch unchanged. Returns whether it is there.
    """
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return False
        callbacks = getattr(frame.f_locals.get("self"), "callbacks", None)
        if isinstance(callbacks, list) and any(c is callback for c in callbacks):
            if not any(isinstance(c, _LogLead) and c.owner is callback for c in callbacks):
                callbacks.insert(0, _LogLead(callback))
            return True
    return False


def find_trainer(depth: int = 8) -> Any | None:
    """The ``transformers.Trainer`` dispatching the callback event being run, or ``None``.

    Events receive no trainer (the ``CallbackHandler`` passes the unwrapped model); the Trainer is the
    ``self`` of a frame a few levels up the stack (Trainer method -> handler event -> ``call_event`` ->
    the callback), a subclass included. ``None`` (a callback called by hand, another dispatcher) keeps
    the behaviour without it: the unwrapped model is audited.
    """
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - this module imports transformers already
        return None
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if isinstance(frame.f_locals.get("self"), Trainer):
            return frame.f_locals["self"]
        frame = frame.f_back  # type: ignore[assignment]
    return None


def trainer_ddp(trainer: Any, model: Any) -> Any | None:
    """The DistributedDataParallel wrapper ``trainer`` trains ``model`` through (``model_wrapped``), or ``None``.

    Marked with :data:`TRAINER_FIX`, so that its hints and warnings offer the fix that works under the
    Trainer. A wrapper over another module (a stale one, a second Trainer's) is not returned.
    """
    ddp = find_ddp(getattr(trainer, "model_wrapped", None)) if trainer is not None else None
    if ddp is None or model is None or (ddp.module is not model and unwrap_module(ddp) is not model):
        return None
    setattr(ddp, FIX_ATTR, TRAINER_FIX)
    return ddp


def epoch_of(state: Any) -> int:
    """The epoch as a whole number: the Trainer's ``state.epoch`` reaches ``1.0`` at the end of epoch 0."""
    return max(0, math.ceil(state.epoch or 0) - 1)


@with_option_properties()
class WeightSyncAuditCallback(TrainerCallback, SessionAdapter):
    """Audit that every rank holds the same weights while a ``transformers.Trainer`` trains.

    Audits at ``on_train_begin``, after every ``every_n_steps`` optimizer steps (``on_step_end``) and at
    ``on_train_end``; with ``"grads"`` in ``include``, gradients and the optimizer (its ``lr`` included)
    at ``on_pre_optimizer_step`` of those steps.

    Args:
        every_n_steps: audit after every N optimizer steps (``state.global_step``); ``None`` audits only
            at train begin and end.
        include, exclude, on_mismatch, resync_src, report_path, timeout_s, coverage, verbose, tolerance,
            pinpoint, pinpoint_ring, pinpoint_coverage, checkpoints, exit_code, sinks, attribution, overlap:
            the fields of :class:`~weightsync_audit.AuditOptions` (documented there and in docs/callback.md);
            ``checkpoints`` writes a sidecar into each ``checkpoint-N`` folder and checks it on resume.
        options: all of the above but the cadence as one :class:`~weightsync_audit.AuditOptions` (then none
            of them may be given flat); each also reads as an attribute (``callback.on_mismatch``).

    The latest audit's ``weightsync/in_sync``, ``weightsync/diverged_tensors`` and ``weightsync/audit_ms``
    go into the next entry of the Trainer's logs (``state.log_history``).

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=data,
                          callbacks=[WeightSyncAuditCallback(every_n_steps=50, on_mismatch="raise")])
    """

    def __init__(
        self,
        every_n_steps: Optional[int] = 100,
        include: Sequence[str] = ("params", "buffers", "optimizer"),
        exclude: Sequence[str] = (),
        on_mismatch: OnMismatch = "warn",
        resync_src: ResyncSource = 0,
        report_path: Optional[str] = None,
        timeout_s: Optional[float] = 600.0,
        coverage: float | str = 1,
        verbose: bool = True,
        tolerance: Optional[float] = None,
        pinpoint: bool = False,
        pinpoint_ring: Optional[int] = None,
        pinpoint_coverage: float | str = 1,
        checkpoints: bool = True,
        exit_code: Optional[int] = None,
        sinks: Sequence[RecordSink] = (),
        attribution: Any = False,
        overlap: bool = False,
        options: AuditOptions | None = None,
        **unknown: Any,
    ) -> None:
        checked_options(type(self).__init__, unknown, type(self).__name__)
        self.every_n_steps = check_every_n(every_n_steps, "every_n_steps")
        self.options = AuditOptions.given(locals(), options)
        """The options, whole (:class:`~weightsync_audit.AuditOptions`); each also reads as an attribute."""
        self.session = TrainerSession(self.options, every_n_steps)
        self.runner = self.session.runner
        self.last_result: AuditResult | None = None
        """The latest audit's result (the same on every rank)."""
        self._unlogged: dict[str, float] = {}
        self._trainer: Any = None
        """A weak reference to the Trainer found at ``on_train_begin`` (:func:`find_trainer`)."""
        self._begun: Any = None
        """The ``TrainerState`` of the last ``on_train_begin`` (each ``train()`` makes a new one)."""
        self.env_options: dict[str, Any] | None = None
        """The options of the ``WEIGHTSYNC_AUDIT`` variable when :meth:`from_env` built this callback."""

    @classmethod
    def from_env(cls) -> list[WeightSyncAuditCallback]:
        """``[WeightSyncAuditCallback(**options)]`` from the ``WEIGHTSYNC_AUDIT`` variable, ``[]`` when it is
        unset or ``0``: the Lightning callback's zero-code switch, for the Trainer (which has no entry point
        for callbacks; :mod:`~weightsync_audit.integrations.hf_activation` adds it to every Trainer). The options are the variable's (``1``: the defaults; ``every_n_steps=50,report_path=
        audit.jsonl``; ``every_n_train_steps`` is read as ``every_n_steps``); a bad one raises, naming it.
        Next to a callback passed explicitly it steps aside at train begin, naming the options dropped.

        Example::

            trainer = Trainer(model=model, args=args, train_dataset=data,
                              callbacks=WeightSyncAuditCallback.from_env())
        """
        from weightsync_audit.integrations.activation import callbacks_from_env, option_names

        return callbacks_from_env(cls, option_names(cls.__init__), rename={"every_n_train_steps": "every_n_steps"})

    def audited(self, model: Any) -> Any:
        """What the audit reads: the Trainer's DDP wrapper over ``model`` when there is one (the names stay
        the model's), else ``model``."""
        trainer = self._trainer() if self._trainer is not None else None
        ddp = trainer_ddp(trainer, model)
        return ddp if ddp is not None else model

    # -- Trainer events ------------------------------------------------------------------------

    @override
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        lead_the_log(self)

    @override
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._begun is state:
            return  # the lead inserted below shifted the handler's list: this dispatch reached us twice
        self._begun = state
        lead_the_log(self)  # again: a callback added with trainer.add_callback missed on_init_end
        trainer = find_trainer()
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        # The one WEIGHTSYNC_AUDIT added next to an explicit callback steps aside, naming the options dropped.
        callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
        is_main = state.is_world_process_zero
        if self.session.step_aside(self, callbacks, WeightSyncAuditCallback, is_main=is_main):
            return
        opened = self.session.open(
            world_size=args.world_size,
            is_main=is_main,
            ddp_broadcast_buffers=buffer_policy(args),
            grads_with_optimizer=True,
        )
        if not opened:
            return
        self.session.watch(self.audited(model), fresh=True)  # each train() warns anew
        self.session.start(state.global_step)
        # resumed: the folder the Trainer loaded (its train() argument), checked against its sidecar
        resumed = resumed_folder(trainer, args, state) if self.checkpoints else None
        sched = kwargs.get("lr_scheduler")
        loaded = (
            Checkpoint("loaded", resumed, resume=hf_resume("loaded", resumed, args, state, sched)) if resumed else None
        )
        self._run(state, model, kwargs.get("optimizer"), "on_train_begin", state.global_step, checkpoint=loaded)

    @override
    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.checkpoints and self.session.opened:
            path = checkpoint_dir(args, state)
            saved = Checkpoint("saved", path, resume=hf_resume("saved", path, args, state, kwargs.get("lr_scheduler")))
            self._run(state, model, kwargs.get("optimizer"), "on_save", state.global_step, checkpoint=saved)

    @override
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        # After backward, before the step: a trainable set that left DDP's reducer behind is warned about
        # before any weight moves (on the main process; every rank checks its own wrapper).
        step, optimizer = state.global_step, kwargs.get("optimizer")
        # The optimizer as the step reads it: an lr changed on one rank is set back by on_step_end.
        optimizers = [optimizer] if optimizer is not None else []
        if self.session.before_step(
            self.audited(model), step, is_main=state.is_world_process_zero, optimizers=optimizers
        ):
            self._run(state, model, kwargs.get("optimizer"), "on_pre_optimizer_step", step + 1, grads=True)

    @override
    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        optimizer = kwargs.get("optimizer")
        optimizers = [optimizer] if optimizer is not None else []
        if self.session.after_step(self.audited(model), optimizers, state.global_step):
            self._run(state, model, optimizer, "on_step_end", state.global_step)

    @override
    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        # Into the entry being logged and the one the Trainer keeps: callbacks after this one (and
        # `trainer.state.log_history`, saved with checkpoints) see the latest audit's figures.
        if not self._unlogged or logs is None:
            return
        logs.update(self._unlogged)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._unlogged)
        self._unlogged = {}

    @override
    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        is_main = state.is_world_process_zero
        if not self.session.opened:
            if self.session.disabled:
                self.session.print_summary(is_main)
            return
        try:
            if self.session.pending_final(state.global_step):
                self._run(state, model, kwargs.get("optimizer"), "on_train_end", state.global_step)
            self.session.print_summary(is_main)
        finally:
            self.session.close()

    # -- the audit -----------------------------------------------------------------------------

    def _run(
        self,
        state: Any,
        model: Any,
        optimizer: Any,
        hook: str,
        step: int,
        grads: bool = False,
        checkpoint: Checkpoint | None = None,
    ) -> AuditResult | None:
        if model is None:
            raise ValueError(f"weightsync audit: the Trainer passed no model to {hook}")
        optimizers = [optimizer] if optimizer is not None else []
        kw: dict[str, Any] = dict(step=step, epoch=epoch_of(state), hook=hook, is_main=state.is_world_process_zero)
        if checkpoint is None:
            kw.update(grads=grads, after_step=hook == "on_step_end")
        result = self.session.audit(self.audited(model), optimizers, checkpoint=checkpoint, **kw)
        if result is None and checkpoint is None and self.runner.overlap is not None:
            result = self.runner.overlap.last  # overlap=True: the last verdict acted on
        if result is not None:
            self.last_result = result
            self._unlogged = audit_metrics(result)
        return result
