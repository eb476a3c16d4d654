"""The callbacks' ``overlap=True``: the audit after each optimizer step runs off the critical path.

:class:`OverlapDriver` is the runner's side of :class:`~weightsync_audit.engine.overlap.OverlapWindow`:
an audit asked for right after a step is launched on the worker thread instead of run, and the verdict is
acted on (``warn``, ``raise`` on every rank together, ``resync`` and confirm, the report, the metrics) at
the next safe point, through the runner's own :meth:`~weightsync_audit.integrations.session.runner.AuditRunner.run`,
so it behaves exactly as the synchronous audit does, one step later. ``raise`` leaves through the next
``optimizer.step()`` (before it writes anything); the record's ``step`` is the step it covers.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from weightsync_audit.engine.auditor import Auditor
from weightsync_audit.engine.overlap import OverlapWindow, PendingAudit
from weightsync_audit.reporting.record import AuditResult

__all__ = ["OverlapDriver"]


class _Runner(Protocol):
    auditor: Auditor | None

    def run(self, model: Any, optimizers: Sequence[Any], **kw: Any) -> AuditResult | None: ...


class OverlapDriver:
    """Launch the after-step audit on the runner's auditor; act on each verdict when it is settled."""

    def __init__(self, runner: _Runner) -> None:
        self.runner = runner
        self.last: AuditResult | None = None
        """The last verdict acted on (``None`` before the first, or when that audit failed under ``warn``)."""
        self._acting: tuple[Any, list[Any], bool, Callable[[dict[str, float]], None] | None] | None = None

    @classmethod
    def of(cls, runner: _Runner, overlap: object) -> OverlapDriver | None:
        """The driver for ``overlap=True``, ``None`` for ``False``; anything else is refused, naming it."""
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap={overlap!r}: must be True or False")
        return cls(runner) if overlap else None

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
