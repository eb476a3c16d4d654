"""The callbacks' behaviour for a plain PyTorch training loop: :class:`LoopAudit`.

It is the same :class:`~weightsync_audit.integrations.session.runner.AuditRunner` the Lightning and Hugging Face
callbacks run on, so ``on_mismatch`` (warn, raise on every rank together, resync and confirm),
``report_path``, ``verbose`` (the table printed on rank 0, once per new divergence), the cadence and the
run summary behave exactly as they do there. :class:`~weightsync_audit.Auditor` stays the bare engine
(an audit returns its result and does nothing else).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

from torch.optim.optimizer import register_optimizer_step_pre_hook

from weightsync_audit.engine.attribution.settle import watch_run
from weightsync_audit.engine.checkpoints.resume_state import ResumeSources
from weightsync_audit.engine.config import OnMismatch, check_flag, check_module, checked_options
from weightsync_audit.engine.inventory.manifest import as_optimizers, before_update, stepping_optimizer
from weightsync_audit.engine.repair.plan import ResyncSource
from weightsync_audit.integrations.session.options import (
    AuditOptions,
    check_every_n,
    with_option_properties,
)
from weightsync_audit.integrations.session.trainer_session import Checkpoint, SessionAdapter, TrainerSession
from weightsync_audit.reporting.jsonl import RecordSink
from weightsync_audit.reporting.record import AuditResult

__all__ = ["LoopAudit"]


@with_option_properties(skip=("checkpoints",))
class LoopAudit(SessionAdapter, contextlib.AbstractContextManager["LoopAudit"]):
    """Audit a plain training loop the way the callbacks audit a Trainer. Collective: every rank calls
    :meth:`step` (or :meth:`audit`) at the same points.

    Args:
        module, optimizer: what is audited (the model or its DDP wrapper; an optimizer or a list of them).
        every_n_steps: :meth:`step` audits when ``step % every_n_steps == 0`` (``None``: only :meth:`audit`).
        check_batches: at each audited :meth:`step` also compare a digest of every rank's ``batch=``: ranks
            that trained on identical batches are named in the record's notes, with or without ``overlap``.
        overlap: :meth:`step` launches the audit and returns ``None``; its verdict is acted on before the next
            ``optimizer.step()``, or at :meth:`settle` / :meth:`close` (docs/performance.md).
        options: the options above (but ``every_n_steps`` and ``check_batches``) as one
            :class:`~weightsync_audit.AuditOptions` (then none of them may be given flat); each also reads as
            an attribute (``audit.on_mismatch``). ``checkpoints`` does not apply: call :meth:`checkpoint_saved`.
        The other arguments are the fields of :class:`~weightsync_audit.AuditOptions` (documented there and in
            docs/callback.md); with ``exit_code``, restart from :meth:`checkpoint_saved`'s checkpoint.

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with LoopAudit(model, opt, every_n_steps=2, on_mismatch="raise", verbose=False) as audit:
    ...     for step in range(1, 5):
    ...         opt.step()
    ...         _ = audit.step(step)
    >>> audit.summary()
    'weightsync audit: 2 audit(s), replicas in sync throughout, last at step 4'
    """

    def __init__(
        self,
        module: Any,
        optimizer: Any = None,
        *,
        every_n_steps: Optional[int] = None,
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
        exit_code: Optional[int] = None,
        sinks: Sequence[RecordSink] = (),
        attribution: Any = False,
        overlap: bool = False,
        check_batches: bool = False,
        options: AuditOptions | None = None,
        **unknown: Any,
    ) -> None:
        checked_options(type(self).__init__, unknown, type(self).__name__)
        self.module = check_module(module)
        self.optimizers = as_optimizers(optimizer)
        self.every_n_steps = check_every_n(every_n_steps, "every_n_steps")
        self.options = AuditOptions.given(locals(), options)
        """The options, whole (:class:`~weightsync_audit.AuditOptions`); each also reads as an attribute."""
        self.check_batches = check_flag(check_batches, "check_batches")
        """At each audited step, ranks that trained on identical batches (a note), with or without ``overlap``."""
        self.session = TrainerSession(self.options, every_n_steps, check_batches=self.check_batches)
        """The lifecycle the callbacks share: opened at the first call, the cadence, the per-step records."""
        self.runner = self.session.runner
        self.is_main = True
        self.last_step = 0
        """The step :meth:`step` last named: the optimizer step under way is the next one."""
        self._epoch: int | None = None
        self._before: int | None = None
        # Right before each of its optimizers' updates, as the callbacks' pre-step hooks: a global hook, so it runs
        # before any hook of the optimizer itself (attribution's), where the overlap settles its verdict; with a
        # closure (LBFGS), after the closure's forward and backward, as Lightning's on_before_optimizer_step.
        stepped = {id(stepping_optimizer(o)) for o in self.optimizers}

        def hook(opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return before_update(args, kwargs, lambda _: self._before_step()) if id(opt) in stepped else None

        self._hooks = [register_optimizer_step_pre_hook(hook)] if stepped else []

    def _open(self) -> None:
        if self.session.opened:
            return
        import torch.distributed as dist

        joined = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if joined else 1
        self.is_main = dist.get_rank() == 0 if joined else True
        self.session.open(world_size=world, is_main=self.is_main, grads_with_optimizer=True)
        watch_run(self.runner, self.module, self.optimizers)

    def _before_step(self) -> None:
        """Before each optimizer step (once per step, however many optimizers): what the callbacks do at
        their pre-step hook; with ``include`` grads, on the cadence, the gradients after the all-reduce."""
        upcoming = self.last_step + 1
        if upcoming == self._before:
            return
        self._before = upcoming
        if "grads" in self.options.include and self.every_n_steps is not None:
            self._open()  # collective: every rank steps its optimizer here
        if self.session.before_step(self.module, self.last_step, is_main=self.is_main, optimizers=self.optimizers):
            self._audit(step=upcoming, epoch=self._epoch, hook="before_optimizer_step", grads=True)

    def _audit(self, **at: Any) -> AuditResult | None:
        """The session's audit of this loop's module and optimizers, ``at`` the step, hook and checkpoint."""
        return self.session.audit(self.module, self.optimizers, is_main=self.is_main, **at)

    def step(self, step: int, epoch: int | None = None, *, batch: Any = None) -> AuditResult | None:
        """Call after every optimizer step: keeps pinpoint's per-step digests, audits on the cadence.
        ``batch``: this rank's batch, compared across ranks at an audited step with ``check_batches``.
        With ``include`` grads, the gradients are audited right before the optimizer step numbered one
        more than the last ``step`` (1 at first), on the same cadence."""
        self._open()
        self.last_step, self._epoch = step, epoch
        if not self.session.after_step(self.module, self.optimizers, step, once=False, batch=batch):
            return None
        # With overlap, launched (the verdict acted on at the next safe point); the same audit either way.
        return self._audit(step=step, epoch=epoch, hook="step", after_step=self.runner.overlap is not None)

    def settle(self) -> AuditResult | None:
        """With ``overlap=True``: wait for the pending audit and act on it now; the last verdict acted on."""
        if self.runner.overlap is None:
            return None
        return self.runner.overlap.settle("settle")

    def audit(self, step: int, epoch: int | None = None, *, hook: str = "audit") -> AuditResult | None:
        """Audit now and act on the result (``on_mismatch``); ``None`` when the audit failed under ``warn``."""
        self._open()
        return self._audit(step=step, epoch=epoch, hook=hook)

    def checkpoint_saved(
        self, path: Any, step: int, epoch: int | None = None, *, state: Any = None,
        resume: ResumeSources | None = None,
    ) -> AuditResult | None:  # fmt: skip
        """Call after saving a checkpoint at ``path`` (on every rank, ``state`` what was saved: default the
        module's ``state_dict``): audit at this step and write its sidecar, ``verified`` only when every
        replica agreed (docs/restarts.md). Acts on a divergence as :meth:`audit` does. ``resume``: what a
        resume must give each rank back (RNG, data position, lr schedulers, grad scaler), into the sidecar."""
        return self._checkpoint(Checkpoint("saved", path, state, resume), step, epoch)

    def checkpoint_loaded(
        self, path: Any, step: int | None = None, epoch: int | None = None, *, state: Any = None,
        resume: ResumeSources | None = None,
    ) -> AuditResult | None:  # fmt: skip
        """Call after loading the checkpoint at ``path``, before the first step: compare what every rank
        holds with the sidecar (a tensor loaded differently is a mismatch naming its ranks; no sidecar:
        ``unverified``). Acts on a divergence as :meth:`audit` does. ``resume``: check that every rank got
        back its own saved resume state (``checkpoint.resume`` in the record)."""
        return self._checkpoint(Checkpoint("loaded", path, state, resume), step, epoch)

    def _checkpoint(self, checkpoint: Checkpoint, step: int | None, epoch: int | None) -> AuditResult | None:
        self._open()
        if checkpoint.event == "loaded" and step is not None:
            self.last_step = step  # resumed: the next optimizer step is the one after it
        return self._audit(checkpoint=checkpoint, step=step, epoch=epoch, hook=f"checkpoint_{checkpoint.event}")

    def close(self) -> None:
        """Settle a pending overlapped audit (acting on it), close the report; with ``verbose``, print the
        run's summary on rank 0."""
        if self.session.opened:
            self.settle()
            self.session.print_summary(self.is_main)
        self.session.close(ended=False)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __exit__(self, *exc: object) -> None:
        self.close()
