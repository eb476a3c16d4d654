"""Audit figures as OpenTelemetry metrics, through the meter of an OpenTelemetry ``MeterProvider``.

:class:`OpenTelemetrySink` is a record sink (``sinks=[...]``): the main process (global rank 0) hands it every
record and it records the figures of :mod:`~weightsync_audit.metrics.figures` on synchronous instruments
(gauges, counters, a histogram) of the ``weightsync_audit`` meter. Where they go is the provider's
business: an OTLP exporter to a collector, the Prometheus exporter, an in-memory reader in tests (extra
``weightsync-audit[otel]``; the SDK's ``MeterProvider``, or the global one set by the application).
"""

from __future__ import annotations

from typing import Any

from opentelemetry import metrics

from weightsync_audit.metrics.figures import DURATION_BUCKETS, GAUGES, gauge_values, record_figures
from weightsync_audit.reporting.record import AuditResult
from weightsync_audit.version import __version__

__all__ = ["OpenTelemetrySink"]


class OpenTelemetrySink:
    """Record each audit on OpenTelemetry instruments named ``weightsync.*``.

    Args:
        meter_provider: the provider whose meter records (default: the global one, which the
            application sets with ``opentelemetry.metrics.set_meter_provider``).
        prefix: the instruments' name prefix.

    >>> from opentelemetry.sdk.metrics import MeterProvider
    >>> from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    >>> reader = InMemoryMetricReader()
    >>> sink = OpenTelemetrySink(meter_provider=MeterProvider(metric_readers=[reader]))
    >>> sink.write(AuditResult(in_sync=True, step=3, world_size=2))
    >>> [m.name for m in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics][:2]
    ['weightsync.in_sync', 'weightsync.step']
    """

    def __init__(self, *, meter_provider: Any = None, prefix: str = "weightsync") -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix={prefix!r}: must be a non-empty instrument name prefix")
        self.meter = metrics.get_meter("weightsync_audit", __version__, meter_provider=meter_provider)
        m, p = self.meter, prefix
        for g in GAUGES:  # in_sync, step, checked, differing, beyond, gap, rel_gap, nonfinite
            setattr(self, g.attr, m.create_gauge(f"{p}.{g.otel}", unit=g.unit, description=g.description))
        self.duration = m.create_histogram(
            f"{p}.audit.duration",
            unit="s",
            description="Seconds each audit took on rank 0",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.audits = m.create_counter(f"{p}.audits", unit="{audit}", description="Audits run")
        self.diverged = m.create_counter(
            f"{p}.audits.diverged", unit="{audit}", description="Audits that found the replicas apart"
        )
        self.resyncs = m.create_counter(
            f"{p}.resyncs", unit="{audit}", description="Audits whose divergence was resynced"
        )
        self.rank = m.create_gauge(
            f"{p}.diverged_rank",
            unit="1",
            description="1 for each rank the last audit found apart (0 once it agrees again)",
        )
        self._named: set[tuple[str, str, str]] = set()
        self.blamed = m.create_gauge(
            f"{p}.blamed_rank",
            unit="1",
            description="1 for each rank the last audit's blame holds responsible (0 once it no longer does)",
        )
        self._blamed: set[tuple[tuple[str, str], ...]] = set()

    def write(self, record: AuditResult) -> None:
        """Record the figures of ``record``; called on the main process."""
        f = record_figures(record)
        for attr, value, labels in gauge_values(f):
            getattr(self, attr).set(value, labels or None)
        self.duration.record(f.audit_seconds)
        self.audits.add(1)
        if not f.in_sync:
            self.diverged.add(1)
        if f.action == "resynced":
            self.resyncs.add(1)
        # A gauge keeps every attribute set it saw: a rank named before and not now goes back to 0.
        now = {(str(p.rank), p.host, p.device) for p in f.ranks}
        for rank, host, device in sorted(self._named | now):
            self.rank.set(int((rank, host, device) in now), {"rank": rank, "host": host, "device": device})
        self._named |= now
        suspect = str(f.hardware_suspect).lower()
        held = {
            (("rank", str(p.rank)), ("host", p.host), ("device", p.device), ("evidence", f.evidence),
             ("hardware_suspect", suspect))
            for p in f.blamed
        }  # fmt: skip
        for attrs in sorted(self._blamed | held):
            self.blamed.set(int(attrs in held), dict(attrs))
        self._blamed |= held
