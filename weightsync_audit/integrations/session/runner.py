"""What every audit callback does, whatever the framework: validate its options, run an audit, act on it.

:class:`AuditRunner` holds the run's one auditor (its audits after a step, the gradients' before it and
the full audit confirming a resync are requests to it, over one channel and one manifest cache), the run's :class:`~weightsync_audit.AuditHistory` and the report writer. The
Lightning and Hugging Face callbacks are adapters: they say *when* to audit and *what* (model,
optimizers, step, epoch), and where metrics go. Every decision that leads to a collective is taken from
data that is equal on every rank (the step, the gathered result); the main process only writes the
report and prints.

With ``overlap=True`` the audit after each optimizer step runs off the critical path: :class:`OverlapDriver`
is the runner's side of :class:`~weightsync_audit.engine.overlap.OverlapWindow`. An audit asked for right
after a step is launched on the worker thread instead of run, and the verdict is acted on (``warn``,
``raise`` on every rank together, ``resync`` and confirm, the report, the metrics) at the next safe point,
through :meth:`AuditRunner.run`, so it behaves exactly as the synchronous audit does, one step later. ``raise`` leaves through the next
``optimizer.step()`` (before it writes anything); the record's ``step`` is the step it covers.

It imports no framework.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

from weightsync_audit.engine.auditor import Auditor
from weightsync_audit.engine.checkpoints.resume_state import ResumeSources, finish_resume
from weightsync_audit.engine.checkpoints.resume_state import capture as capture_resume
from weightsync_audit.engine.checkpoints.verify import checkpoint_loaded, checkpoint_saved
from weightsync_audit.engine.config import AuditRequest
from weightsync_audit.engine.context import AuditHistory
from weightsync_audit.engine.inventory.manifest import as_optimizers
from weightsync_audit.engine.measure.finite import persistent_hints
from weightsync_audit.engine.overlap import OverlapWindow, PendingAudit
from weightsync_audit.engine.respond import Voice, respond, say_raising
from weightsync_audit.engine.timeline.step_records import StepHyper
from weightsync_audit.errors import WeightDivergenceError, warn_user
from weightsync_audit.integrations.evict import hand_off_problems, leave_together, write_evict
from weightsync_audit.integrations.session.options import AuditOptions, with_option_properties
from weightsync_audit.reporting.jsonl import RecordSinks, ReportWriter
from weightsync_audit.reporting.record import AuditResult

__all__ = [
    "AuditRunner",
    "OverlapDriver",
    "audit_metrics",
]

log = logging.getLogger("weightsync_audit")


def audit_metrics(result: AuditResult) -> dict[str, float]:
    """The numbers a callback logs per audit: ``weightsync/in_sync``, ``diverged_tensors``, ``audit_ms``."""
    return {
        "weightsync/in_sync": float(result.in_sync),
        "weightsync/diverged_tensors": float(len(result.mismatches)),
        "weightsync/audit_ms": float(result.duration_ms),
    }


class OverlapDriver:
    """Launch the after-step audit on the runner's auditor; act on each verdict when it is settled."""

    def __init__(self, runner: AuditRunner) -> None:
        self.runner = runner
        self.last: AuditResult | None = None
        """The last verdict acted on (``None`` before the first, or when that audit failed under ``warn``)."""
        self._acting: tuple[Any, list[Any], bool, Callable[[dict[str, float]], None] | None] | None = None

    def launch(
        self,
        model: Any,
        optimizers: Sequence[Any],
        *,
        is_main: bool,
        log_metrics: Callable[[dict[str, float]], None] | None,
        **at: Any,
    ) -> None:
        """Launch the audit of ``model`` at ``at`` (the ``step``, ``epoch`` and ``hook`` the runner's ``run``
        was given); its verdict is acted on when it settles."""
        auditor = self.runner.auditor
        assert auditor is not None
        if auditor.window is None:
            auditor.window = OverlapWindow(auditor)
        auditor.window.on_settled = self._act
        auditor.launch(model, list(optimizers) or None, **at)
        self._acting = (model, list(optimizers), is_main, log_metrics)  # set after: launch settles the last one

    def settle(self, where: str) -> AuditResult | None:
        """Take the pending verdict now (a safe point) and act on it; the last verdict acted on."""
        auditor = self.runner.auditor
        if auditor is not None and auditor.window is not None:
            auditor.window.settle(where)
        return self.last

    def close(self) -> None:
        auditor = self.runner.auditor
        if auditor is not None:
            auditor.close()

    def _act(self, pending: PendingAudit) -> None:
        assert self._acting is not None and pending.step is not None
        model, optimizers, is_main, log_metrics = self._acting

        def verdict(*_: Any, **__: Any) -> AuditResult:
            return pending.result()

        self.last = None
        self.last = self.runner.run(
            model, optimizers, step=pending.step, epoch=pending.epoch, hook=pending.hook or "step",
            is_main=is_main, log_metrics=log_metrics, audit=verdict,
        )  # fmt: skip


@with_option_properties(skip=("sinks", "overlap"), settable=True)
class AuditRunner:
    """Run audits for a callback and act on them: ``warn``, ``raise`` (on every rank) or ``resync``.

    It takes the adapter's :class:`AuditOptions` whole (each field also reads as an attribute:
    ``runner.on_mismatch``) and the adapter's cadence ``every_n``, which sizes the pinpoint ring.

    >>> import torch
    >>> runner = AuditRunner(AuditOptions(on_mismatch="raise"))
    >>> runner.open(world_size=1, is_main=True)
    >>> model = torch.nn.Linear(2, 2)
    >>> runner.run(model, [], step=0, epoch=0, hook="example", is_main=True).in_sync
    True
    >>> runner.close()
    """

    def __init__(
        self, options: AuditOptions | None = None, *, every_n: Optional[int] = None, check_batches: bool = False
    ) -> None:
        self.options = AuditOptions() if options is None else options
        """The adapter's options, whole (validated when they were built; errors name the argument)."""
        # One AuditConfig, passed whole to the auditors; the adapter's cadence sizes the pinpoint ring;
        # ``check_batches`` (LoopAudit's): the main auditor's audits compare the batches recorded per step.
        self.config = replace(self.options.audit_config(every_n), check_batches=bool(check_batches))
        # The main process hands the sinks each record (weightsync_audit.metrics).
        self.sinks = RecordSinks(self.options.sinks)
        self.history = AuditHistory()
        self.console: Any = None
        """A ``rich.console.Console`` for reports on the main process (stderr when ``None``)."""
        self.auditor: Auditor | None = None
        """The run's one auditor: its audits after a step, and the ones beside them (:attr:`grads`, confirms)."""
        self.grads: AuditRequest | None = None
        """The gradient audit before a step (``include`` grads), made by :meth:`open`."""
        self.confirms: tuple[AuditRequest, AuditRequest] | None = None
        """A resync confirmed by a full audit of the kinds compared, and of the gradients too when they moved."""
        self.writer: ReportWriter | None = None
        self.voice = Voice()
        """What the main process has said so far (each fact once; a persisting cause compacted)."""
        self.failures: list[str] = []
        """Audits that failed under ``warn``, noted in the next record written."""
        self._warned_failures: set[str] = set()
        self.is_main = False
        self.last_step_recorded: int | None = None
        self.resynced_ranks: dict[int, int] = {}
        """Ranks a resync repaired (those that received a copy), with the step: a divergence that comes back on
        them is a cause that persists (on the machine only on evidence about it)."""
        self.step_hyper = StepHyper(self.config.exclude) if "optimizer" in self.config.include else None
        """The hyper-parameters each optimizer step read (:meth:`record_hyper`), the main audit's evidence."""
        self.overlap = OverlapDriver(self) if self.options.overlap else None  # validated by AuditOptions
        """With ``overlap=True``: the audit right after a step runs while the next one does (docs/performance.md)."""

    # -- set-up and teardown -------------------------------------------------------------------

    def open(
        self,
        *,
        world_size: int,
        is_main: bool,
        ddp_broadcast_buffers: bool | None = None,
        grads_with_optimizer: bool = False,
        engine: type[Auditor] = Auditor,
    ) -> None:
        """Build the auditor and open the audit channel (collective: every rank calls it).

        ``ddp_broadcast_buffers``: the DDP buffer policy when the callback is handed the unwrapped model
        (``None``: read it from the wrapper). ``grads_with_optimizer``: the gradient audit also compares
        the optimizer (its state and each group's ``lr``), as it stands right before the step. ``engine``: the
        auditor's class, one whose ``setup`` and ``comm`` are another channel's (torchft's quorum channel).
        """
        self.is_main = is_main
        for problem in hand_off_problems() if is_main else []:  # local: a warning, never a rank of its own
            warn_user(f"weightsync: {problem}: the evict hand-off cannot be written there")
        if self.on_mismatch == "resync" and self.resync_src != "majority" and self.resync_src >= world_size:
            raise ValueError(f"resync_src={self.resync_src}: the run has only {world_size} rank(s)")
        main_include = tuple(k for k in self.include if k != "grads") or ("params",)
        config = replace(self.config, ddp_broadcast_buffers=ddp_broadcast_buffers, include=main_include)
        self.auditor = engine(config=config)
        self.auditor.history = self.history
        self.auditor.step_hyper = self.step_hyper
        if "grads" in self.include:
            with_opt = ("optimizer",) if grads_with_optimizer and "optimizer" in self.include else ()
            self.grads = AuditRequest(include=("grads", *with_opt), full=True, counted=False, before_step=True)
        # A resync is confirmed by a full audit of what the audits compare: the gradients too when they moved.
        plain = AuditRequest(include=main_include, full=True, counted=False)
        with_grads = AuditRequest(include=(*main_include, "grads"), full=True, counted=False)
        self.confirms = (plain, with_grads if self.grads is not None else plain)
        if is_main and self.report_path is not None:
            # A report that cannot be written (full disk) warns and keeps records: it never ends the run.
            self.writer = ReportWriter(self.report_path, keep_on_error=True)
        # Open the audit channel now, while every rank is known to be here (it is collective).
        self.auditor.setup()

    def close(self) -> None:
        """Close the report (idempotent); the audit channel stays cached for the process's next run."""
        if self.overlap is not None:
            self.overlap.close()  # the pending verdict acted on first (collective, as the audit was)
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    # -- the audit -----------------------------------------------------------------------------

    def record_step(self, model: Any, optimizers: Sequence[Any], step: int) -> None:
        """After each optimizer step, locally (no message): attribution's record of it closed under ``step``; with
        ``pinpoint``, what the audit covers digested, once per optimizer step."""
        if self.auditor is not None and self.auditor.attribution is not None:
            self.auditor.attribution.mark(step)
        if self.auditor is None or not self.config.pinpoint or step == self.last_step_recorded:
            return
        self.last_step_recorded = step
        try:
            self.auditor.record_step(step, model, list(optimizers) or None)
        except Exception as exc:
            if self.on_mismatch != "warn":
                raise
            # Local, no message: a failure here cannot leave another rank waiting. Under warn, a tensor the
            # audit cannot read warns (once per kind, on the rank it happens) and training goes on.
            kind = f"record_step {type(exc).__name__}"
            if kind not in self._warned_failures:
                self._warned_failures.add(kind)
                warn_user(
                    f"weightsync audit: pinpoint could not digest step {step}; training goes on "
                    f"(on_mismatch='warn'): {type(exc).__name__}: {exc}"
                )

    def record_hyper(self, optimizers: Sequence[Any], step: int) -> None:
        """Right before optimizer step ``step`` (local): the hyper-parameters it reads, which a scheduler may set
        back before the audit after it (:mod:`~weightsync_audit.engine.timeline.step_records`)."""
        if self.step_hyper is not None and self.auditor is not None:
            self.step_hyper.record(step, as_optimizers(list(optimizers)))

    def run(
        self,
        model: Any,
        optimizers: Sequence[Any],
        *,
        step: int,
        epoch: int | None,
        hook: str,
        is_main: bool,
        grads: bool = False,
        log_metrics: Callable[[dict[str, float]], None] | None = None,
        audit: Callable[..., AuditResult] | None = None,
        after_step: bool = False,
        failure_warns: bool = False,
    ) -> AuditResult | None:
        """Audit, act on the result, report it on the main process; raise on every rank if asked.

        ``log_metrics`` (main process only) receives :func:`audit_metrics` before any raise. ``audit``
        replaces the auditor's own (a checkpoint's: :meth:`checkpoint`). ``after_step`` with ``overlap=True``:
        launched, acted on at the next safe point (returns ``None``; ``overlap.last``: the last acted on).
        ``failure_warns``: an audit that fails warns and returns ``None`` whatever ``on_mismatch`` (torchft's)."""
        auditor = self.auditor
        if auditor is None or self.confirms is None or (grads and self.grads is None):
            return None
        if self.overlap is not None:
            if after_step and audit is None and not grads:
                return self.overlap.launch(
                    model, optimizers, step=step, epoch=epoch, hook=hook, is_main=is_main, log_metrics=log_metrics
                )
            self.overlap.settle("another audit")  # the channel is used in order: the pending verdict first
        t0 = time.perf_counter()
        try:
            request = self.grads if grads else None
            kw: dict[str, Any] = {} if audit is not None else {"request": request}
            result = (audit or auditor.audit)(model, list(optimizers) or None, step=step, epoch=epoch, hook=hook, **kw)
        except Exception as exc:
            if self.on_mismatch != "warn" and not failure_warns:
                raise
            self._audit_failed(hook, step, exc, is_main)
            return None
        result.notes[:0], self.failures = self.failures, []
        if not result.in_sync and self.resynced_ranks:
            result.hints += persistent_hints(result.mismatches, result.blame, self.resynced_ranks, result.hosts)
        if grads:
            self._note_grad_result(result)
        confirms = self.confirms

        def confirm(grads_moved: bool) -> AuditResult:
            # The confirming audit compares every kind that had diverged: gradients too when they had; after
            # the gradient audit, what it compared (the parameters it did not compare are the next audit's).
            request = self.grads if grads else confirms[1] if grads_moved else confirms[0]
            return auditor.audit(model, list(optimizers) or None, step=step, epoch=epoch, hook=hook, request=request)

        plan = respond(
            result,
            self.on_mismatch,
            model=model,
            optimizers=optimizers,
            resync_src=self.resync_src,
            confirm=confirm,
            history=self.history,
            prepare=auditor.resync_state,  # the audit's channel and manifest, not prepared again
            repaired=auditor.repaired,  # its per-step evidence dropped
        )
        if result.action == "resynced" and plan is not None:  # a rank that diverges again after this: named
            self.resynced_ranks.update({r: step for r in plan.receivers(result.mismatches)})
            if self.step_hyper is not None:  # confirmed: what was found is about a divergence that is over
                self.step_hyper.forget()
                if grads and optimizers:  # repaired before the step: the step reads the repaired values
                    self.record_hyper(optimizers, step)
        result.duration_ms = (time.perf_counter() - t0) * 1e3
        self._publish(result, is_main, log_metrics, "grads" if grads else "main")
        if not result.in_sync:
            self._end_divergent(result, auditor.comm, is_main)
        return result

    def _end_divergent(self, result: AuditResult, comm: Any, is_main: bool) -> None:
        """A divergent result's last acts: the host to evict handed where schedulers look; under ``raise``,
        this rank's line said, then its exit (``exit_code``) or the exception, on every rank alike."""
        rank, exit_code = comm.global_ranks[comm.rank], self.exit_code if result.action == "raised" else None
        write_evict(result, rank=rank, is_main=is_main, exit_code=exit_code)
        if result.action == "raised":
            say_raising(result, rank, is_main)
            if self.exit_code is not None:
                self._exit(result, is_main)
            raise WeightDivergenceError(result)

    def checkpoint(
        self, event: str, path: Any, model: Any, optimizers: Sequence[Any], *, state: Any = None,
        resume: ResumeSources | None = None, **kw: Any,
    ) -> AuditResult | None:  # fmt: skip
        """:meth:`run` at a checkpoint ``event`` (``saved``: audit and write its sidecar; ``loaded``: audit and
        compare every rank with the sidecar); ``resume``: also every rank's resume state (docs/restarts.md);
        the keyword arguments are :meth:`run`'s."""
        if self.auditor is None:
            return None
        fn = checkpoint_saved if event == "saved" else checkpoint_loaded
        auditor = self.auditor

        def audit(module: Any, optimizer: Any, *, step: int, epoch: int | None, hook: str) -> AuditResult:
            mine = capture_resume(resume) if resume is not None else None  # before the audit: nothing moves it
            result = fn(auditor, path, step, state=state, module=module, optimizer=optimizer, epoch=epoch, hook=hook)
            finish_resume(result, auditor.comm, event, path, mine, kw.get("is_main", False))
            return result

        return self.run(model, optimizers, audit=audit, **kw)

    def _exit(self, result: AuditResult, is_main: bool) -> None:
        """End this process with :attr:`exit_code` (every rank at this same point, from the same record)."""
        if self.writer is not None:
            self.writer.close()
        if is_main:
            sys.stderr.write(
                f"weightsync audit: {result.summary()}; exiting with status {self.exit_code} (exit_code=) so that "
                "the run restarts from its last verified checkpoint\n"
            )
        sys.stdout.flush()
        sys.stderr.flush()
        if self.auditor is not None:  # no rank leaves before the first wrote the record and the evict file
            leave_together(self.auditor.comm, is_main)
        os._exit(int(self.exit_code or 1))  # no teardown that could wait on a peer: every rank leaves here

    def _audit_failed(self, hook: str, step: int, exc: Exception, is_main: bool) -> None:
        """Under ``warn`` a failed audit (a rank late or gone, a broken channel) is reported and training
        goes on; once the channel is broken every later audit fails at once, with a message saying so."""
        text = f"{type(exc).__name__}: {exc}"
        self.failures = [*self.failures[-19:], f"the audit at step {step} ({hook}) failed: {text}"]
        kind = type(exc).__name__ + (" (channel gone)" if "unusable after an earlier failure" in text else "")
        if is_main and kind not in self._warned_failures:
            self._warned_failures.add(kind)
            warn_user(f"weightsync audit at step {step} ({hook}) failed; training goes on: {text}")

    def _note_grad_result(self, result: AuditResult) -> None:
        # The gradient auditor keeps its own history (its audits interleave with the main ones); a
        # divergence it finds first is still the run's first divergence.
        if not result.in_sync:
            self.history.diverged(result)
        result.last_in_sync_step = result.step if result.in_sync else self.history.last_in_sync_step
        result.last_full_sync_step = self.history.last_full_sync_step

    def _publish(
        self,
        result: AuditResult,
        is_main: bool,
        log_metrics: Callable[[dict[str, float]], None] | None,
        kind: str = "main",
    ) -> None:
        """Report on the main process: the record, metrics, and a printed report when it says something new
        for its ``kind`` of audit (``grads``, before the step, and ``main`` alternate without each counting
        as a change)."""
        if not is_main:
            self.voice.heard(result, kind)  # the same memory on every rank (a Lightning checkpoint keeps it)
            return
        if self.writer is not None:
            self.writer.write(result)
        self.sinks.write(result)
        if log_metrics is not None:
            log_metrics(audit_metrics(result))
        self.voice.speak(result, verbose=self.verbose, print_fn=self.print, kind=kind)

    def print(self, renderable: Any) -> None:
        """Print with rich on the main process's console (stderr unless ``console`` is set); off a
        terminal (CI logs) one line per verdict, never wrapped at 80 columns."""
        from weightsync_audit.reporting.render import log_console

        console = self.console or log_console(sys.stderr)
        console.print(renderable)
