"""Audit figures as OpenTelemetry metrics, through the meter of an OpenTelemetry ``MeterProvider``.

:class:`OpenTelemetrySink` is a record sink (``sinks=[...]``): the main process (global rank 0) hands it every
record and it records the figures of :mod:`weightsync_audit.metrics` on synchronous instruments
(gauges, counters, a histogram) of the ``weightsync_audit`` meter. Where they go is the provider's
business: an OTLP exporter to a collector, the Prometheus exporter, an in-memory reader in tests (extra
``weightsync-audit[otel]``; the SDK's ``MeterProvider``, or the global one set by the application).
"""

from __future__ import annotations

from typing import Any

from opentelemetry import metrics

from weightsync_audit import __version__
from weightsync_audit.metrics import DURATION_BUCKETS, GAUGES, gauge_values, place_labels, record_figures
from weightsync_audit.reporting.record import AuditResult

__all__ = ["OpenTelemetrySink"]


class _Instruments:
    """The meter and the instruments of one sink, made where the sink is first used."""

    def __init__(self, provider: Any, prefix: str) -> None:
        self.meter = metrics.get_meter("weightsync_audit", __version__, meter_provider=provider)
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
        self.blamed = m.create_gauge(
            f"{p}.blamed_rank",
            unit="1",
            description="1 for each rank the last audit's blame holds responsible (0 once it no longer does)",
        )


def _is_factory(provider: Any) -> bool:
    """A function or class that builds the provider (not a provider itself)."""
    return callable(provider) and (isinstance(provider, type) or not hasattr(provider, "get_meter"))


class OpenTelemetrySink:
    """Record each audit on OpenTelemetry instruments named ``weightsync.*``.

    Args:
        meter_provider: the provider whose meter records (default: the global one, which the
            application sets with ``opentelemetry.metrics.set_meter_provider``), or a function of no
            argument that returns one (called where the sink is first used).
        prefix: the instruments' name prefix.

    The meter is made where the sink is first used, so the sink travels to spawned workers unless given a
    provider object (docs/metrics.md).

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
        if meter_provider is not None and not hasattr(meter_provider, "get_meter") and not callable(meter_provider):
            raise ValueError(
                f"meter_provider={meter_provider!r}: give an OpenTelemetry MeterProvider or a function returning one"
            )
        self.prefix = prefix
        self._provider = meter_provider
        self._instruments: _Instruments | None = None
        self._named: set[tuple[tuple[str, str], ...]] = set()
        self._blamed: set[tuple[tuple[str, str], ...]] = set()

    @property
    def meter(self) -> Any:
        """The ``weightsync_audit`` meter the figures are recorded on (made at its first use)."""
        return self._state().meter

    def _state(self) -> _Instruments:
        if self._instruments is None:
            provider = self._provider() if _is_factory(self._provider) else self._provider
            self._instruments = _Instruments(provider, self.prefix)
        return self._instruments

    def __getstate__(self) -> dict[str, Any]:
        """What a copy in another process is built from: the options, never a live provider."""
        if self._provider is not None and not _is_factory(self._provider):
            raise TypeError(
                f"OpenTelemetrySink(meter_provider={self._provider!r}) cannot be sent to another process "
                "(Lightning's ddp_spawn, Ray): the provider lives in this one. Set the global provider in each "
                "process (opentelemetry.metrics.set_meter_provider) and leave meter_provider unset, or give a "
                "function that builds the provider"
            )
        return {"meter_provider": self._provider, "prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def write(self, record: AuditResult) -> None:
        """Record the figures of ``record``; called on the main process."""
        f, m = record_figures(record), self._state()
        for attr, value, labels in gauge_values(f):
            getattr(m, attr).set(value, labels or None)
        m.duration.record(f.audit_seconds)
        m.audits.add(1)
        if not f.in_sync:
            m.diverged.add(1)
        if f.action == "resynced":
            m.resyncs.add(1)
        # A gauge keeps every attribute set it saw: a rank named before and not now goes back to 0.
        for gauge, seen, labels in zip((m.rank, m.blamed), (self._named, self._blamed), place_labels(f)):
            now = {tuple(one.items()) for one in labels}
            for attrs in sorted(seen | now):
                gauge.set(int(attrs in now), dict(attrs))
            seen |= now
