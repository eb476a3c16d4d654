"""Where else records go: objects with a ``write(record)`` method, handed every record the main process writes.

A record sink is what ``sinks=[...]`` takes in the callbacks, :class:`~weightsync_audit.LoopAudit` and the
runner: the metrics exporters (:mod:`weightsync_audit.metrics`) are sinks, and so is any object with a
``write(record: AuditResult)`` method. Sinks receive the record on the main process (global rank 0) only,
right after the JSONL report, before any raise or exit. A sink that fails never ends the run: the first
failure of each sink warns (:class:`~weightsync_audit.WeightSyncWarning`) and the next record is offered
to it again.

It imports no optional package.
"""

from __future__ import annotations

import warnings
from typing import Protocol, Sequence, runtime_checkable

from weightsync_audit.errors import WeightSyncWarning, user_stacklevel
from weightsync_audit.reporting.record import AuditResult

__all__ = ["RecordSink", "RecordSinks"]


@runtime_checkable
class RecordSink(Protocol):
    """Anything that takes the audit records: ``write(record)`` on the main process, once per audit."""

    def write(self, record: AuditResult) -> None: ...


class RecordSinks:
    """The sinks of one runner, each record offered to each in order; a failing sink warns once and is kept.

    >>> class Count:
    ...     n = 0
    ...     def write(self, record): self.n += 1
    >>> c = Count()
    >>> RecordSinks([c]).write(AuditResult(in_sync=True))
    >>> c.n
    1
    >>> RecordSinks([print])
    Traceback (most recent call last):
    ValueError: sinks[0]=<built-in function print>: a record sink needs a write(record) method (e.g. weightsync_audit.metrics.PrometheusSink)
    """

    def __init__(self, sinks: Sequence[RecordSink] = ()) -> None:
        if isinstance(sinks, (str, bytes)):
            raise ValueError(f"sinks={sinks!r}: give a list of sink objects (e.g. [PrometheusSink(port=9400)])")
        if isinstance(sinks, RecordSink):
            sinks = [sinks]
        try:
            self.sinks: tuple[RecordSink, ...] = tuple(sinks)
        except TypeError:
            raise ValueError(
                f"sinks={sinks!r}: give a list of sink objects (e.g. [PrometheusSink(port=9400)])"
            ) from None
        for i, sink in enumerate(self.sinks):
            if not callable(getattr(sink, "write", None)):
                raise ValueError(
                    f"sinks[{i}]={sink!r}: a record sink needs a write(record) method "
                    "(e.g. weightsync_audit.metrics.PrometheusSink)"
                )
        self._failing: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def write(self, record: AuditResult) -> None:
        """Offer ``record`` to every sink; a sink's error is a warning (once per sink until it works again)."""
        for i, sink in enumerate(self.sinks):
            try:
                sink.write(record)
            except Exception as exc:  # noqa: BLE001 - an exporter never ends the user's training
                if i not in self._failing:
                    self._failing.add(i)
                    warnings.warn(
                        f"weightsync audit: the record sink {type(sink).__name__} failed on the record of step "
                        f"{record.step} ({type(exc).__name__}: {exc}); training goes on and the next record is "
                        "offered to it again",
                        WeightSyncWarning,
                        stacklevel=user_stacklevel(),
                    )
            else:
                self._failing.discard(i)
