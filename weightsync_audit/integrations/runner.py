"""What every audit callback does, whatever the framework: validate its options, run an audit, act on it.

:class:`AuditRunner` holds the auditors (the main one, one for gradients, one to confirm a resync, all
over one audit channel), the run's :class:`~weightsync_audit.AuditHistory` and the report writer. The
Lightning and Hugging Face callbacks are adapters: they say *when* to audit and *what* (model,
optimizers, step, epoch), and where metrics go. Every decision that leads to a collective is taken from
data that is equal on every rank (the step, the gathered result); the main process only writes the
report and prints.

It imports no framework.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

from weightsync_audit.checkpoints.verify import checkpoint_loaded, checkpoint_saved
from weightsync_audit.engine.auditor import Auditor
from weightsync_audit.engine.config import AuditConfig, OnMismatch, check_on_mismatch, parse_coverage
from weightsync_audit.engine.measure.stability import persistent_hints
from weightsync_audit.engine.repair.resync import resync
from weightsync_audit.engine.repair.resync_plan import ResyncSource, check_resync_src, plan_resync
from weightsync_audit.engine.timeline.history import AuditHistory
from weightsync_audit.engine.timeline.pinpoint import DEFAULT_RING
from weightsync_audit.errors import WeightDivergenceError, WeightSyncWarning
from weightsync_audit.integrations.worker_history import HistoryHandoff, summary_outside_workers
from weightsync_audit.reporting.jsonl import ReportWriter, check_report_path
from weightsync_audit.reporting.record import AuditResult

__all__ = ["EXIT_DIVERGED", "AuditRunner", "audit_metrics", "check_every_n", "check_exit_code"]

EXIT_DIVERGED = 17
"""The suggested ``exit_code``: the replicas diverged; restart from the last verified checkpoint."""

log = logging.getLogger("weightsync_audit")


def check_every_n(value: object, argument: str) -> Optional[int]:
    """Validate an audit cadence (``every_n_train_steps``, ``every_n_steps``): an integer >= 1 or ``None``.

    >>> check_every_n(50, "every_n_steps")
    50
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{argument}={value!r}: must be an integer >= 1, or None to turn the cadence off")
    return value


def check_exit_code(value: object, on_mismatch: str) -> Optional[int]:
    """Validate ``exit_code``: ``None``, or an integer 1..255 together with ``on_mismatch="raise"``.

    >>> check_exit_code(17, "raise")
    17
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 255:
        raise ValueError(f"exit_code={value!r}: must be an integer from 1 to 255, or None")
    if on_mismatch != "raise":
        raise ValueError(f"exit_code={value!r} acts on a divergence under on_mismatch='raise', not {on_mismatch!r}")
    return value


def audit_metrics(result: AuditResult) -> dict[str, float]:
    """The numbers a callback logs per audit: ``weightsync/in_sync``, ``diverged_tensors``, ``audit_ms``."""
    return {
        "weightsync/in_sync": float(result.in_sync),
        "weightsync/diverged_tensors": float(len(result.mismatches)),
        "weightsync/audit_ms": float(result.duration_ms),
    }


class AuditRunner:
    """Run audits for a callback and act on them: ``warn``, ``raise`` (on every rank) or ``resync``.

    The arguments are the callbacks' own, validated here so that every callback's errors name them alike.

    >>> import torch
    >>> runner = AuditRunner(on_mismatch="raise")
    >>> runner.open(world_size=1, is_main=True)
    >>> model = torch.nn.Linear(2, 2)
    >>> runner.run(model, [], step=0, epoch=0, hook="example", is_main=True).in_sync
    True
    >>> runner.close()
    """

    def __init__(
        self,
        *,
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
        every_n: Optional[int] = None,
        exit_code: Optional[int] = None,
    ) -> None:
        # One AuditConfig, validated here (errors name the argument), passed whole to the auditors.
        self.config = AuditConfig(
            include=tuple(include) if not isinstance(include, str) else include,  # type: ignore[arg-type]
            exclude=exclude if isinstance(exclude, str) else tuple(exclude),  # type: ignore[arg-type]
            timeout_s=timeout_s,
            slices=parse_coverage(coverage),
            tolerance=tolerance,
            pinpoint=bool(pinpoint),
            # By default the ring holds two audit intervals of steps (and at least DEFAULT_RING).
            pinpoint_ring=max(DEFAULT_RING, 2 * (every_n or 0) + 16) if pinpoint_ring is None else pinpoint_ring,
            pinpoint_slices=parse_coverage(pinpoint_coverage),
        )
        self.on_mismatch = check_on_mismatch(on_mismatch)
        self.exit_code = check_exit_code(exit_code, self.on_mismatch)
        """With ``on_mismatch="raise"``: every rank ends its process with this status after the record is
        written (docs/restarts.md), so ``torchrun --max-restarts`` or a scheduler restarts the run."""
        resync_src = check_resync_src(resync_src)
        if report_path is not None:
            check_report_path(report_path, "report_path")
        self.include = self.config.include
        self.exclude = self.config.exclude
        self.slices = self.config.slices
        self.resync_src = resync_src
        self.report_path = None if report_path is None else str(report_path)
        self.timeout_s = timeout_s
        self.coverage = coverage
        self.verbose = verbose
        self.history = AuditHistory()
        self.console: Any = None
        """A ``rich.console.Console`` for reports on the main process (stderr when ``None``)."""
        self.auditor: Auditor | None = None
        self.grad_auditor: Auditor | None = None
        self.confirm_auditor: Auditor | None = None
        self.writer: ReportWriter | None = None
        self.last_reported: tuple[str, ...] = ()
        """The diverged names last reported, so a divergence is printed when it appears or changes."""
        self.failures: list[str] = []
        """Audits that failed under ``warn``, noted in the next record written."""
        self._warned_failures: set[str] = set()
        self.handoff = HistoryHandoff()
        """The main process's history back to the process that built the runner (ddp_fork/ddp_spawn)."""
        self.is_main = False
        self.from_workers = False
        self.last_step_recorded: int | None = None
        self.resynced_ranks: dict[int, int] = {}
        """Ranks a resync repaired, with the step: one that diverges again has a persistent fault."""

    # -- set-up and teardown -------------------------------------------------------------------

    def open(
        self,
        *,
        world_size: int,
        is_main: bool,
        ddp_broadcast_buffers: bool | None = None,
        grads_with_optimizer: bool = False,
    ) -> None:
        """Build the auditors and open the audit channel (collective: every rank calls it).

        ``ddp_broadcast_buffers``: the DDP buffer policy when the callback is handed the unwrapped model
        (``None``: read it from the wrapper). ``grads_with_optimizer``: the gradient audit also compares
        the optimizer (its state and each group's ``lr``), as it stands right before the step.
        """
        self.is_main = is_main
        if self.on_mismatch == "resync" and self.resync_src != "majority" and self.resync_src >= world_size:
            raise ValueError(f"resync_src={self.resync_src}: the run has only {world_size} rank(s)")
        base = replace(self.config, ddp_broadcast_buffers=ddp_broadcast_buffers)
        main_include = tuple(k for k in self.include if k != "grads") or ("params",)
        self.auditor = Auditor(config=replace(base, include=main_include))
        self.auditor.history = self.history
        if "grads" in self.include:
            with_opt = ("optimizer",) if grads_with_optimizer and "optimizer" in self.include else ()
            self.grad_auditor = Auditor(config=replace(base, include=("grads", *with_opt), slices=1, pinpoint=False))
            self.grad_auditor.use_channel_of(self.auditor)
        # A resync is confirmed by a full audit (every slice) of what the main auditor compares.
        self.confirm_auditor = Auditor(config=replace(base, include=main_include, slices=1, pinpoint=False))
        self.confirm_auditor.use_channel_of(self.auditor)
        if is_main and self.report_path is not None:
            # A report that cannot be written (full disk) warns and keeps records: it never ends the run.
            self.writer = ReportWriter(self.report_path, keep_on_error=True)
        # Open the audit channel now, while every rank is known to be here (it is collective).
        self.auditor.setup()

    def close(self) -> None:
        """Close the report (idempotent), and leave the history for the process that built the runner
        when that is another one (the parent of ddp_fork/ddp_spawn workers). The audit channel stays
        cached for the process's next run."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.is_main and self.auditor is not None:
            self.handoff.put(self.history.state_dict())

    # -- the audit -----------------------------------------------------------------------------

    def record_step(self, model: Any, optimizers: Sequence[Any], step: int) -> None:
        """With ``pinpoint``: digest, locally, what the audit covers, once per optimizer step (no message)."""
        if self.auditor is None or not self.config.pinpoint or step == self.last_step_recorded:
            return
        self.last_step_recorded = step
        self.auditor.record_step(step, model, list(optimizers) or None)

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
    ) -> AuditResult | None:
        """Audit, act on the result, report it on the main process; raise on every rank if asked.

        ``log_metrics`` (main process only) receives :func:`audit_metrics` before any raise. ``audit``
        replaces the auditor's own (a checkpoint's: :meth:`checkpoint`).
        """
        auditor = self.grad_auditor if grads else self.auditor
        if auditor is None:
            return None
        t0 = time.perf_counter()
        try:
            result = (audit or auditor.audit)(model, list(optimizers) or None, step=step, epoch=epoch, hook=hook)
        except Exception as exc:
            if self.on_mismatch != "warn":
                raise
            self._audit_failed(hook, step, exc, is_main)
            return None
        result.notes[:0], self.failures = self.failures, []
        if not result.in_sync and self.resynced_ranks:
            result.hints += persistent_hints(result.mismatches, self.resynced_ranks, result.hosts)
        if grads:
            self._note_grad_result(result)
        if result.in_sync or result.within_tolerance:
            result.action = "none"  # within the tolerance: kept in the record, not acted on
        elif self.on_mismatch == "raise":
            result.action = "raised"
        elif self.on_mismatch == "resync":
            self._resync(result, model, list(optimizers), step, epoch, hook)
        else:
            result.action = "warned"
        result.duration_ms = (time.perf_counter() - t0) * 1e3
        self._publish(result, is_main, log_metrics)
        if not result.in_sync and result.action == "raised":
            if self.exit_code is not None:
                self._exit(result, is_main)
            raise WeightDivergenceError(result)
        return result

    def checkpoint(
        self, event: str, path: Any, model: Any, optimizers: Sequence[Any], *, state: Any = None, **kw: Any
    ) -> AuditResult | None:
        """:meth:`run` at a checkpoint ``event`` (``saved``: audit and write its sidecar; ``loaded``: audit and
        compare every rank with the sidecar); the keyword arguments are :meth:`run`'s."""
        if self.auditor is None:
            return None
        fn = checkpoint_saved if event == "saved" else checkpoint_loaded
        auditor = self.auditor

        def audit(module: Any, optimizer: Any, *, step: int, epoch: int | None, hook: str) -> AuditResult:
            return fn(auditor, path, step, state=state, module=module, optimizer=optimizer, epoch=epoch, hook=hook)

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
        os._exit(int(self.exit_code or 1))  # no teardown that could wait on a peer: every rank leaves here

    def _audit_failed(self, hook: str, step: int, exc: Exception, is_main: bool) -> None:
        """Under ``warn`` a failed audit (a rank late or gone, a broken channel) is reported and training
        goes on; once the channel is broken every later audit fails at once, with a message saying so."""
        text = f"{type(exc).__name__}: {exc}"
        self.failures = [*self.failures[-19:], f"the audit at step {step} ({hook}) failed: {text}"]
        kind = type(exc).__name__ + (" (channel gone)" if "unusable after an earlier failure" in text else "")
        if is_main and kind not in self._warned_failures:
            self._warned_failures.add(kind)
            warnings.warn(
                f"weightsync audit at step {step} ({hook}) failed; training goes on (on_mismatch='warn'): {text}",
                WeightSyncWarning,
                stacklevel=4,
            )

    def _note_grad_result(self, result: AuditResult) -> None:
        # The gradient auditor keeps its own history (its audits interleave with the main ones); a
        # divergence it finds first is still the run's first divergence.
        if not result.in_sync:
            self.history.diverged_audits += 1
            if self.history.first_divergence_step is None:
                self.history.first_divergence_step = result.step
                ordered = sorted(result.mismatches, key=lambda m: m.kind != "param")  # parameters first
                self.history.first_divergence_tensors = [m.name for m in ordered]
        result.last_in_sync_step = result.step if result.in_sync else self.history.last_in_sync_step
        result.last_full_sync_step = self.history.last_full_sync_step

    def _resync(
        self, result: AuditResult, model: Any, optimizers: list[Any], step: int, epoch: int | None, hook: str
    ) -> None:
        structural = [m.name for m in result.mismatches if m.kind == "structure"]
        if structural:
            result.action = "raised"
            result.notes.append(f"resync impossible: the structure differs ({', '.join(structural[:5])})")
            return
        # Each tensor from a rank holding its reference value (engine/resync_plan.py): the same plan on
        # every rank, from the same record; one broadcast per source rank.
        plan = plan_resync(result.mismatches, self.resync_src)
        result.notes.extend(plan.notes)
        for source, tensors in plan.sources.items():
            resync(model, optimizers or None, src=source, names=tensors, timeout_s=self.timeout_s)
        assert self.confirm_auditor is not None
        confirm = self.confirm_auditor.audit(model, optimizers or None, step=step, epoch=epoch, hook=hook)
        if confirm.in_sync:
            result.action = "resynced"
            result.notes.append(f"resynced {plan.describe()}; a full audit confirmed the replicas are in sync")
            self.history.resyncs += 1
            self.resynced_ranks.update({r: step for m in result.mismatches for r in m.ranks})
            self.history.last_in_sync_step = step
            self.history.last_full_sync_step = step
            if self.auditor is not None and self.auditor.pinpointer is not None:
                self.auditor.pinpointer.in_sync(step)  # pinpoint starts afresh
        else:
            result.action = "raised"
            result.notes.append(f"resync ({plan.describe()}) did not restore agreement: {confirm.summary()}")

    def _publish(
        self, result: AuditResult, is_main: bool, log_metrics: Callable[[dict[str, float]], None] | None
    ) -> None:
        """Report on the main process: the record, metrics, and a printed report when the divergence changes."""
        if not is_main:
            self.last_reported = tuple(result.diverged_names) if not result.in_sync else ()
            return
        if self.writer is not None:
            self.writer.write(result)
        if log_metrics is not None:
            log_metrics(audit_metrics(result))
        if result.in_sync or result.within_tolerance:
            self.last_reported = ()
            return
        names = tuple(result.diverged_names)
        if names != self.last_reported or result.action in ("raised", "resynced"):
            if self.verbose:
                self.print(result)
            else:
                log.warning("weightsync audit: %s", result.summary())
        self.last_reported = names

    def print(self, renderable: Any) -> None:
        """Print with rich on the main process's console (stderr unless ``console`` is set); off a
        terminal (CI logs) one line per verdict, never wrapped at 80 columns."""
        from weightsync_audit.reporting.render import log_console

        console = self.console or log_console(sys.stderr)
        console.print(renderable)

    def summary(self, disabled: str | None = None) -> str:
        """One line over the whole run: audits, the first divergence, resyncs.

        In a process that ran no audit itself (the parent of ddp_fork/ddp_spawn workers) it is the main
        worker's history, handed back; failing that, the report read back, or a plain statement.
        """
        h = self.history
        if disabled:
            return f"weightsync audit: not audited ({disabled})"
        if self.auditor is None and h.audits == 0:
            state = self.handoff.take()
            if state is None:
                return summary_outside_workers(self.report_path)
            h.load_state_dict(state)
            self.from_workers = True
        where = " (audited in the worker processes; this is rank 0's history)" if self.from_workers else ""
        if h.diverged_audits == 0:
            last = f", last at step {h.last_in_sync_step}" if h.last_in_sync_step is not None else ""
            return f"weightsync audit: {h.audits} audit(s), replicas in sync throughout{last}{where}"
        first = ", ".join(h.first_divergence_tensors[:5])
        if h.first_diverged_step is not None:
            first += f"; diverged from step {h.first_diverged_step} (pinpointed)"
        return (
            f"weightsync audit: {h.audits} audit(s), {h.diverged_audits} found divergence; first at step "
            f"{h.first_divergence_step} ({first}); last in sync at step {h.last_in_sync_step}; "
            f"{h.resyncs} resync(s){where}"
        )
