"""One audit's life inside a trainer, whatever the framework: :class:`TrainerSession`.

The Lightning callback, the Hugging Face callback and :class:`~weightsync_audit.LoopAudit` each translate
their framework's events into calls on one: open once (or stay disabled, with a reason said once), step
aside when the ``WEIGHTSYNC_AUDIT`` variable added a second callback next to the user's, keep pinpoint's
and attribution's per-step records, audit on the cadence (once per optimizer step), watch the trainable
set before each step, audit at the checkpoints the trainer saves and loads (their sidecars), and say the
run's summary, also in a process that ran no audit itself (the parent of ``ddp_spawn`` / ``ddp_fork``
workers: global rank 0 hands its history back through a small file, :class:`HistoryHandoff`; failing that,
the report is read back; failing that, it says plainly where the audits ran). The
session takes every decision that leads to a collective from data equal on every rank (the step, the
options); the main process only warns and prints. It imports no framework.

>>> import torch
>>> from weightsync_audit import AuditOptions
>>> session = TrainerSession(AuditOptions(verbose=False), every_n=2)
>>> session.open(world_size=1, is_main=True)
True
>>> model = torch.nn.Linear(2, 2)
>>> [session.after_step(model, [], step) for step in (1, 2, 2, 3, 4)]
[False, True, False, False, True]
>>> session.audit(model, [], step=2, epoch=0, hook="example", is_main=True).in_sync
True
>>> session.close()
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Sequence

from weightsync_audit.ddp.inspect import TrainableSetWatch
from weightsync_audit.engine.attribution.settle import watch_run
from weightsync_audit.engine.checkpoints.resume_state import ResumeSources
from weightsync_audit.engine.context import AuditHistory
from weightsync_audit.errors import warn_user
from weightsync_audit.integrations.session.options import AuditOptions
from weightsync_audit.integrations.session.runner import AuditRunner
from weightsync_audit.reporting.jsonl import read_report
from weightsync_audit.reporting.record import AuditResult
from weightsync_audit.text import ENV_VAR, dropped_message, last_in_sync

__all__ = [
    "Checkpoint",
    "HistoryHandoff",
    "SessionAdapter",
    "TrainerSession",
    "added_by_env",
    "read_back",
]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint the trainer just saved or loaded, to audit against its sidecar."""

    event: Literal["saved", "loaded"]
    path: Any
    state: Any = None
    """What was saved (default: the module's ``state_dict``), digested into the sidecar."""
    resume: ResumeSources | None = None
    """What a resume must give each rank back (RNG, data position, schedulers), checked or recorded."""


def added_by_env(callback: Any) -> bool:
    """Whether ``callback`` was added by the ``WEIGHTSYNC_AUDIT`` variable (it keeps the options it read)."""
    return getattr(callback, "env_options", None) is not None


class HistoryHandoff:
    """A file through which a worker's audit history reaches the process that built the callback.

    >>> h = HistoryHandoff()
    >>> h.put({"audits": 3}, force=True)   # a worker process writes without force
    >>> h.take()
    {'audits': 3}
    >>> h.take() is None
    True
    """

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.path = Path(tempfile.gettempdir()) / f"weightsync-audit-history-{self.owner}-{uuid.uuid4().hex}.json"
        atexit.register(self._cleanup)

    def put(self, state: dict[str, Any], *, force: bool = False) -> None:
        """Leave ``state`` for the owner when this is another process (atomically; a failure to write
        only costs the hand-off). In the owner itself the history is already at hand: nothing is written."""
        if os.getpid() == self.owner and not force:
            return
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path)
        except (OSError, TypeError, ValueError):
            tmp.unlink(missing_ok=True)

    def take(self) -> dict[str, Any] | None:
        """The state a worker left, once (in the owner process only), or ``None``."""
        if os.getpid() != self.owner:
            return None
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        self.path.unlink(missing_ok=True)
        return state if isinstance(state, dict) else None

    def _cleanup(self) -> None:
        if os.getpid() == self.owner:
            self.path.unlink(missing_ok=True)


def read_back(report_path: str | None, history: AuditHistory) -> str | None:
    """For a process that ran no audit itself (the parent of ``ddp_spawn`` / ``ddp_fork`` workers):
    ``report_path``'s records replayed into ``history`` (``None``), or, with nothing to read, a summary
    saying plainly that no audit ran here.

    >>> read_back(None, AuditHistory())[:56]
    'weightsync audit: no audit ran in this process (under dd'
    """
    where = (
        "no audit ran in this process (under ddp_spawn, ddp_fork and other launchers that start the ranks "
        "as child processes the audits run in the workers, and their history ends with them)"
    )
    if report_path is None:
        return (
            f"weightsync audit: {where}; pass report_path=... to keep the run's record and read it here, or see "
            "the report printed by rank 0 during fit"
        )
    if not os.path.isfile(report_path):
        return f"weightsync audit: {where}; the report {report_path} does not exist (the run did not audit?)"
    try:
        rs = [r for _, r in read_report(report_path).records]
    except OSError as exc:
        return f"weightsync audit: {where}; the report {report_path} cannot be read ({exc})"
    if not rs:
        return f"weightsync audit: {where}; the report {report_path} holds no valid record"
    for r in rs:
        history.record(r)
        history.resyncs += r.action == "resynced"
    return None


class TrainerSession:
    """The framework-free lifecycle of an audit callback; the adapters only translate hooks into calls."""

    def __init__(self, options: AuditOptions, every_n: Optional[int], *, check_batches: bool = False) -> None:
        self.runner = AuditRunner(options, every_n=every_n, check_batches=check_batches)
        """Audits, acts and reports (it holds the options whole)."""
        self.every_n = every_n
        self.opened = False
        self.disabled: str | None = None
        """Why this run is not audited (a sharded strategy, a duplicate from the variable), or ``None``."""
        self.last_step_audited: int | None = None
        self.trainable = TrainableSetWatch()
        self.handoff = HistoryHandoff()
        """The main process's history back to the process that built the session (ddp_fork/ddp_spawn)."""
        self.from_workers = ""
        """How :meth:`summary` says where the history of a process that ran no audit itself came from."""

    @property
    def options(self) -> AuditOptions:
        """The options the session runs with."""
        return self.runner.options

    @property
    def active(self) -> bool:
        """Open and not disabled: the hooks audit."""
        return self.opened and not self.disabled

    # -- set-up and teardown -------------------------------------------------------------------

    def open(self, *, world_size: int, is_main: bool, disabled: str | None = None, **open_kw: Any) -> bool:
        """Open the runner (collective: every rank calls it), unless ``disabled`` says why not (warned on the
        main process) or :meth:`step_aside` already disabled the session. Whether it opened."""
        if self.disabled is None:
            self.disabled = disabled
            if disabled and is_main:
                warn_user(disabled)
        if self.disabled:
            return False
        self.runner.open(world_size=world_size, is_main=is_main, **open_kw)
        self.opened = True
        return True

    def step_aside(self, callback: Any, callbacks: Iterable[Any], kind: type, *, is_main: bool) -> bool:
        """When ``callback`` came from ``WEIGHTSYNC_AUDIT`` and ``callbacks`` hold an explicit one of ``kind``:
        disable this session (rather than audit and report everything twice), warn naming the options dropped."""
        self.disabled = None
        own = [c for c in callbacks if isinstance(c, kind) and c is not callback and not added_by_env(c)]
        if not added_by_env(callback) or not own:
            return False
        name = type(own[0]).__name__
        self.disabled = f"the Trainer already has a {name}; the one from {ENV_VAR} is not used"
        if is_main:
            warn_user(dropped_message(callback, name))
        return True

    def start(self, step: int) -> None:
        """Training starts at ``step``: the cadence does not audit it again."""
        self.last_step_audited = step

    def watch(self, model: Any, *, fresh: bool = False) -> None:
        """Remember what DDP's reducer covers now, right after the wrap (local)."""
        if fresh:
            self.trainable = TrainableSetWatch()
        self.trainable.snapshot(model)

    def close(self, *, ended: bool = True) -> None:
        """Close the report (idempotent). ``ended``: no hook audits until the next :meth:`open` (the Hugging
        Face Trainer's next ``train()``); ``False`` keeps the auditors for hooks that follow (Lightning's
        ``validate`` after ``fit``)."""
        self.runner.close()
        if self.runner.is_main and self.runner.auditor is not None:  # for the parent of ddp_fork/ddp_spawn workers
            self.handoff.put(self.runner.history.state_dict())
        self.opened = self.opened and not ended

    # -- the steps -----------------------------------------------------------------------------

    def before_step(
        self, model: Any, step: int, *, is_main: bool, hook: bool = False, optimizers: Sequence[Any] = ()
    ) -> bool:
        """After backward, before the optimizer step: warn (once, main process) if the trainable set left DDP's
        reducer behind, and keep the hyper-parameters ``optimizers`` hold for the step (local: a scheduler may
        set an lr back before the audit after it); whether the gradients are to be audited now (the cadence's
        step, or ``hook``)."""
        if not self.active:
            return False
        self.runner.record_hyper(optimizers, step + 1)
        if self.trainable.check(model, step, warn=is_main):
            self.runner.voice.note_said(self.trainable.said, f"the warning at step {step}")
        upcoming = step + 1
        on_cadence = self.every_n is not None and upcoming % self.every_n == 0
        return self.runner.grads is not None and (on_cadence or hook)

    def after_step(
        self, model: Any, optimizers: Sequence[Any], step: int, *, once: bool = True, batch: Any = None
    ) -> bool:
        """After each optimizer step: the weights it left, recorded (pinpoint, attribution; local); whether the
        cadence audits this step (``once``: not a step already audited, as gradient accumulation repeats it).
        ``batch``: with ``check_batches``, this rank's batch, recorded for the audit of this step (local)."""
        if self.active and model is not None:
            watch_run(self.runner, model, optimizers)  # attribution's watch, set once
            self.runner.record_step(model, optimizers, step)
        if self.every_n is None or step % self.every_n or (once and step == self.last_step_audited):
            return False
        self.last_step_audited = step
        auditor = self.runner.auditor
        if self.active and auditor is not None and auditor.batches is not None:
            auditor.record_batch(step, batch)  # the audit of this step consumes it, however it is scheduled
        return True

    def pending_final(self, step: int) -> bool:
        """At the end of training: whether ``step`` still needs an audit (the last one was not of it)."""
        if not self.active or step == self.last_step_audited:
            return False
        self.last_step_audited = step
        return True

    # -- the audit -----------------------------------------------------------------------------

    def audit(
        self, model: Any, optimizers: Sequence[Any], *, checkpoint: Checkpoint | None = None, **kw: Any
    ) -> AuditResult | None:
        """Audit now (the runner's :meth:`~AuditRunner.run`, or its :meth:`~AuditRunner.checkpoint` for a
        ``checkpoint``) and act on it; ``None`` when the session is not active or the audit failed under warn."""
        if not self.active:
            return None
        if checkpoint is not None:
            c = checkpoint
            return self.runner.checkpoint(c.event, c.path, model, optimizers, state=c.state, resume=c.resume, **kw)
        return self.runner.run(model, optimizers, **kw)

    def summary(self) -> str:
        """One line over the whole run: audits, the first divergence, resyncs.

        In a process that ran no audit itself (the parent of ddp_fork/ddp_spawn workers) it is the main
        worker's history, handed back; failing that, the report read back, or a plain statement.
        """
        h = self.runner.history
        if self.disabled:
            return f"weightsync audit: not audited ({self.disabled})"
        if self.runner.auditor is None and h.audits == 0:
            state = self.handoff.take()
            if state is not None:
                h.load_state_dict(state)
                self.from_workers = " (audited in the worker processes; this is rank 0's history)"
            elif (plain := read_back(self.options.report_path, h)) is not None:
                return plain
            else:  # the same line as a live history's, from the records
                path = self.options.report_path
                self.from_workers = f"; read back from {path} (the audits ran in the worker processes)"
        where = self.from_workers
        if h.diverged_audits == 0 and h.audits and h.compared_nothing == h.audits:
            return (
                f"weightsync audit: {h.audits} audit(s), none compared a tensor between ranks (nothing to audit, "
                f"or nothing with a replica: see the records' notes), so none says the replicas agree{where}"
            )
        if h.diverged_audits == 0:
            last = f", last at step {h.last_in_sync_step}" if h.last_in_sync_step is not None else ""
            return f"weightsync audit: {h.audits} audit(s), replicas in sync throughout{last}{where}"
        first = ", ".join(h.first_divergence_tensors[:5])
        if h.first_diverged_step is not None:
            first += f"; diverged from step {h.first_diverged_step} (pinpointed)"
        return (
            f"weightsync audit: {h.audits} audit(s), {h.diverged_audits} found divergence; first at step "
            f"{h.first_divergence_step} ({first}); {last_in_sync(h.first_divergence_step, h.last_in_sync_step)}; "
            f"{h.resyncs} resync(s){where}"
        )

    def print_summary(self, is_main: bool) -> None:
        """Print :meth:`summary` on the main process with ``verbose``."""
        if is_main and self.options.verbose:
            self.runner.print(self.summary())


class SessionAdapter:
    """What an adapter that holds its :class:`TrainerSession` as ``session`` answers from it alike
    (:class:`~weightsync_audit.LoopAudit`, ``TorchFTAudit``)."""

    session: TrainerSession

    @property
    def history(self) -> Any:
        """The run's :class:`~weightsync_audit.AuditHistory` (audits, first divergence, resyncs)."""
        return self.session.runner.history

    def summary(self) -> str:
        """One line over the audits this process took part in, as every adapter says it."""
        return self.session.summary()
