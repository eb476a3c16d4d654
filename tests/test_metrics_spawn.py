"""Record sinks under Lightning's ``ddp_spawn`` (issue 43, item 4): the callback, its sinks with it, is pickled
to each spawned worker, so a sink must pickle and build its live state (registry, endpoint, meter) on the rank
that writes. One real 2-rank spawn run covers both sinks: rank 0's Prometheus textfile and what its OpenTelemetry
provider recorded are read back and must count exactly the records of the report."""

from __future__ import annotations

import functools
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("opentelemetry.sdk")
import pytorch_lightning as pl
from lightning_helpers import SmallModel, fit, rank_end, records
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from weightsync_audit import AuditResult, WeightSyncAudit
from weightsync_audit.metrics import OpenTelemetrySink, PrometheusSink

READERS: list[Any] = []
"""The in-memory readers of the providers built in this process (in a worker: its own)."""


def otel_provider() -> Any:
    """A MeterProvider with an in-memory reader, built where the sink is first used (the worker)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    READERS.append(InMemoryMetricReader())
    return MeterProvider(metric_readers=[READERS[-1]])


class DumpOtel(pl.Callback):
    """Sets each worker's global OpenTelemetry provider as an application does (once, at its start); at the end
    of the fit, rank 0 writes what its reader holds: ``{name: [values]}``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from opentelemetry import metrics

        metrics.set_meter_provider(otel_provider())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        out: dict[str, list[float]] = {}
        for reader in READERS:
            for rm in reader.get_metrics_data().resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        out.setdefault(m.name, []).extend(p.value for p in m.data.data_points if hasattr(p, "value"))
        self.path.write_text(json.dumps({"pid_readers": len(READERS), "metrics": out}))


def _samples(path: Path) -> dict[str, float]:
    return {
        s.name: s.value for f in text_string_to_metric_families(path.read_text()) for s in f.samples if not s.labels
    }


def test_prometheus_and_opentelemetry_sinks_travel_to_ddp_spawn_workers_and_rank_0_exports(
    tmp_path: Path, warm_spawn: None
) -> None:
    prom = PrometheusSink(textfile=tmp_path / "weightsync.prom")
    otel = OpenTelemetrySink()  # the global provider: the worker's own, set there
    report = tmp_path / "audit.jsonl"
    audit = WeightSyncAudit(every_n_train_steps=2, report_path=str(report), verbose=False, sinks=[prom, otel])
    fit(tmp_path, SmallModel(), [audit, DumpOtel(tmp_path / "otel.json")], strategy="ddp_spawn", max_epochs=1)
    assert rank_end(tmp_path, 0)["ended"] == rank_end(tmp_path, 1)["ended"] == "ok"
    recs = records(report)
    assert len(recs) >= 4 and all(r["in_sync"] for r in recs), recs
    written = _samples(tmp_path / "weightsync.prom")  # by rank 0's worker, on its own registry
    assert written["weightsync_audits_total"] == len(recs) and written["weightsync_in_sync"] == 1.0, written
    assert written["weightsync_step"] == recs[-1]["step"]
    otel_seen = json.loads((tmp_path / "otel.json").read_text())
    assert otel_seen["pid_readers"] == 1, otel_seen  # rank 0's worker recorded on its own provider
    assert otel_seen["metrics"]["weightsync.audits"] == [len(recs)], otel_seen
    assert READERS == []  # nothing was built in this (the parent) process


def test_a_sink_copied_to_another_process_keeps_its_options_and_starts_empty(tmp_path: Path) -> None:
    from prometheus_client import REGISTRY

    prom = PrometheusSink(port=0, addr="127.0.0.1", textfile=tmp_path / "a.prom", namespace="ws")
    prom.write(AuditResult(in_sync=True, step=3, world_size=2))
    copy = pickle.loads(pickle.dumps(prom))
    assert (copy.port, copy.addr, copy.textfile, copy.namespace) == (0, "127.0.0.1", prom.textfile, "ws")
    assert copy.url is None and copy.registry.get_sample_value("ws_audits_total") == 0.0  # its own, fresh
    prom.close()
    assert pickle.loads(pickle.dumps(PrometheusSink(registry=REGISTRY))).registry is REGISTRY
    factory = functools.partial(CollectorRegistry, auto_describe=True)
    assert isinstance(pickle.loads(pickle.dumps(PrometheusSink(registry=factory))).registry, CollectorRegistry)
    copy = pickle.loads(pickle.dumps(OpenTelemetrySink(meter_provider=otel_provider, prefix="ws")))
    assert copy.prefix == "ws" and READERS == []  # built at its first use only
    copy.write(AuditResult(in_sync=True, step=1, world_size=2))
    assert len(READERS) == 1
    READERS.clear()


@pytest.mark.parametrize("make, named", [
    (lambda: PrometheusSink(registry=CollectorRegistry()), "registry="),
    (lambda: OpenTelemetrySink(meter_provider=otel_provider()), "meter_provider="),
])  # fmt: skip
def test_a_sink_holding_a_live_object_of_this_process_refuses_to_travel_naming_it(make: Any, named: str) -> None:
    with pytest.raises(TypeError, match=f"{named}.*cannot be sent to another process"):
        pickle.dumps(WeightSyncAudit(sinks=[make()]))
    READERS.clear()
