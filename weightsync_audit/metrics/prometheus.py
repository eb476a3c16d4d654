"""Audit figures as Prometheus metrics: an HTTP endpoint to scrape, a node_exporter textfile, or both.

:class:`PrometheusSink` is a record sink (``sinks=[...]`` in the callbacks and :class:`~weightsync_audit.LoopAudit`):
the main process (global rank 0) hands it every record and it sets the metrics of
:mod:`weightsync_audit.metrics` with the official client, ``prometheus_client`` (extra
``weightsync-audit[prometheus]``). The endpoint starts with the first record, so that only the process that
exports binds the port (every worker builds the callback; only rank 0 writes). docs/metrics.md lists the
metrics.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Callable

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
    write_to_textfile,
)

from weightsync_audit.metrics import DURATION_BUCKETS, GAUGES, GaugeSpec, gauge_values, place_labels, record_figures
from weightsync_audit.reporting.jsonl import check_report_path
from weightsync_audit.reporting.record import AuditResult

__all__ = ["PrometheusSink"]

_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_GLOBAL = "prometheus_client.REGISTRY"
"""How a sink on the process's own registry travels: each process joins its own."""


class _Metrics:
    """The registry and the metrics of one sink, built where the sink is first used."""

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
        self.registry, self.namespace = registry, namespace
        ns, reg = namespace, registry
        self.nonfinite: Gauge | None = None  # made at the first record that counts (check_finite=True)
        for g in GAUGES:  # in_sync, step, checked, differing, beyond, gap, rel_gap
            if g.attr != "nonfinite":
                setattr(self, g.attr, self.gauge(g))
        self.duration = Histogram(
            "audit_duration_seconds",
            "Seconds each audit took on rank 0",
            namespace=ns,
            registry=reg,
            buckets=DURATION_BUCKETS,
        )
        self.audits = Counter("audits", "Audits run", namespace=ns, registry=reg)
        self.diverged = Counter("diverged_audits", "Audits that found the replicas apart", namespace=ns, registry=reg)
        self.resyncs = Counter("resyncs", "Audits whose divergence was resynced", namespace=ns, registry=reg)
        self.rank = Gauge(
            "diverged_rank",
            "1 for each rank the last audit found apart from the reference, with its machine",
            ["rank", "host", "device"],
            namespace=ns,
            registry=reg,
        )
        self.blamed = Gauge(
            "blamed_rank",
            "1 for each rank the last audit's blame holds responsible, with its machine and the evidence",
            ["rank", "host", "device", "evidence", "hardware_suspect"],
            namespace=ns,
            registry=reg,
        )

    def gauge(self, g: GaugeSpec) -> Gauge:
        labels = [g.label] if g.label else []
        return Gauge(g.prometheus, g.description, labels, namespace=self.namespace, registry=self.registry)


class PrometheusSink(contextlib.AbstractContextManager["PrometheusSink"]):
    """Publish each audit record as Prometheus metrics (``weightsync_in_sync``, ``weightsync_tensors_differing`` ...).

    Args:
        port: serve ``/metrics`` on this port from the first record on (``0``: a free port, then read
            :attr:`port`); ``None``: no endpoint (a ``registry`` you serve, or a ``textfile``).
        addr: the address the endpoint listens on (``0.0.0.0``, as prometheus_client's own, for a
            Prometheus server on another machine; ``127.0.0.1`` keeps it on this one).
        textfile: write the metrics to this file after every record (atomically, for node_exporter's
            textfile collector: a ``.prom`` file in its ``--collector.textfile.directory``).
        registry: the ``CollectorRegistry`` to register in (default: one of its own, so that two sinks in
            one process never collide; pass ``prometheus_client.REGISTRY`` to join the process's own), or a
            function of no argument that returns one (called where the sink is first used).
        namespace: the metric names' prefix.

    The registry and the endpoint are built where the sink is first used, so the sink travels to spawned
    workers unless given a registry object of its own (docs/metrics.md).

    >>> sink = PrometheusSink()
    >>> sink.write(AuditResult(in_sync=True, step=3, world_size=2))
    >>> sink.registry.get_sample_value("weightsync_in_sync"), sink.registry.get_sample_value("weightsync_step")
    (1.0, 3.0)
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        addr: str = "0.0.0.0",
        textfile: str | os.PathLike[str] | None = None,
        registry: CollectorRegistry | Callable[[], CollectorRegistry] | None = None,
        namespace: str = "weightsync",
    ) -> None:
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise ValueError(f"port={port!r}: must be an integer from 0 (a free port) to 65535, or None")
        if not isinstance(namespace, str) or not _NAME.match(namespace):
            raise ValueError(f"namespace={namespace!r}: must be a Prometheus name ([a-zA-Z_][a-zA-Z0-9_]*)")
        if registry is not None and not isinstance(registry, CollectorRegistry) and not callable(registry):
            raise ValueError(
                f"registry={registry!r}: give a prometheus_client CollectorRegistry or a function returning one"
            )
        self.textfile = None if textfile is None else str(check_report_path(textfile, "textfile"))
        self.addr = addr
        self.namespace = namespace
        self.port = port
        """The endpoint's port (the one bound when ``port=0`` was asked, once it serves)."""
        self._asked = port
        self._registry = registry
        self._metrics: _Metrics | None = None
        self._server: Any = None

    @property
    def registry(self) -> CollectorRegistry:
        """The registry the metrics are in (built at its first use)."""
        return self._state().registry

    def _state(self) -> _Metrics:
        if self._metrics is None:
            given = self._registry
            if given is None:
                registry = CollectorRegistry(auto_describe=True)
            elif isinstance(given, CollectorRegistry):
                registry = given
            else:
                registry = given()
                if not isinstance(registry, CollectorRegistry):
                    raise TypeError(
                        f"registry={given!r} returned {registry!r}, not a prometheus_client CollectorRegistry"
                    )
            self._metrics = _Metrics(registry, self.namespace)
        return self._metrics

    def __getstate__(self) -> dict[str, Any]:
        """What a copy in another process is built from: the options, never the registry's live state."""
        given = self._registry
        if isinstance(given, CollectorRegistry) and given is not REGISTRY:
            raise TypeError(
                f"PrometheusSink(registry={given!r}) cannot be sent to another process (Lightning's ddp_spawn, "
                "Ray): the registry lives in this one. Give port= or textfile=, registry=prometheus_client.REGISTRY "
                "(each process's own), or a function that builds the registry"
            )
        registry = _GLOBAL if given is REGISTRY else given
        options = {"addr": self.addr, "textfile": self.textfile, "namespace": self.namespace}
        return {"port": self._asked, "registry": registry, **options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        registry = REGISTRY if state["registry"] == _GLOBAL else state["registry"]
        self.__init__(**{**state, "registry": registry})  # type: ignore[misc]

    def serve(self) -> int:
        """Start the ``/metrics`` endpoint now (it starts with the first record otherwise); returns the port."""
        if self._server is None:
            if self.port is None:
                raise ValueError("PrometheusSink(port=None) serves no endpoint; give port= (0: a free one)")
            self._server, _ = start_http_server(self.port, addr=self.addr, registry=self.registry)
            self.port = int(self._server.server_port)
        return int(self.port)

    @property
    def url(self) -> str | None:
        """``http://ADDR:PORT/metrics`` once the endpoint serves, else None."""
        if self._server is None:
            return None
        host = "127.0.0.1" if self.addr in ("0.0.0.0", "") else self.addr
        return f"http://{host}:{self.port}/metrics"

    def write(self, record: AuditResult) -> None:
        """Set the metrics from ``record`` (and rewrite the textfile); called on the main process."""
        f, m = record_figures(record), self._state()
        for attr, value, labels in gauge_values(f):
            if getattr(m, attr) is None:  # nonfinite, at the first record that counts
                setattr(m, attr, m.gauge(next(g for g in GAUGES if g.attr == attr)))
            gauge = getattr(m, attr)
            (gauge.labels(**labels) if labels else gauge).set(value)
        m.duration.observe(f.audit_seconds)
        m.audits.inc()
        if not f.in_sync:
            m.diverged.inc()
        if f.action == "resynced":
            m.resyncs.inc()
        for gauge, labels in zip((m.rank, m.blamed), place_labels(f)):
            gauge.clear()
            for one in labels:
                gauge.labels(**one).set(1)
        if self.port is not None:
            self.serve()
        if self.textfile is not None:
            write_to_textfile(self.textfile, m.registry)

    def close(self) -> None:
        """Stop the endpoint (the metrics stay in the registry)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __exit__(self, *exc: object) -> None:
        self.close()
