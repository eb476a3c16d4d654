"""Metrics exporters on a real 2-rank gloo run: a Prometheus endpoint scraped over HTTP on localhost, its textfile,
and OpenTelemetry through an in-memory reader and through its Prometheus exporter (scraped too)."""

from __future__ import annotations

import math
import socket
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_setup import tiny_trainer
from ranks import run_ranks

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

from weightsync_audit import AuditResult, LoopAudit, Mismatch, WeightSyncWarning
from weightsync_audit.metrics import PrometheusSink, record_figures
from weightsync_audit.reporting.jsonl import RecordSinks

PLANTED = 0.5


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of what a real GET of ``url`` returns (less OTel's scope labels)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope")))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _prometheus_rank(rank: int, world: int, folder: str) -> dict[str, Any]:
    model, opt = _model()
    sink = PrometheusSink(port=0, addr="127.0.0.1", textfile=Path(folder) / f"rank{rank}.prom")
    audit = LoopAudit(model, opt, every_n_steps=1, verbose=False, sinks=[sink])
    audit.step(1)  # healthy
    healthy = scrape(sink.url) if sink.url else None
    if rank == 1:
        with torch.no_grad():
            model.weight[0, 0] += PLANTED  # the planted divergence
    result = audit.step(2)
    diverged = scrape(sink.url) if sink.url else None
    audit.close()
    sink.close()
    return {"healthy": healthy, "diverged": diverged, "in_sync": result.in_sync, "url": sink.url}


def test_rank_0_serves_the_audit_figures_over_http_and_the_scrape_shows_the_planted_divergence(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_prometheus_rank, 2, str(tmp_path))
    assert r0["in_sync"] is False and r1["in_sync"] is False  # the verdict on both ranks
    assert r1["healthy"] is None and r1["diverged"] is None  # only rank 0 exports: rank 1 bound no port
    assert not (tmp_path / "rank1.prom").exists()
    h, d = r0["healthy"], r0["diverged"]
    assert h[("weightsync_in_sync", ())] == 1.0 and h[("weightsync_step", ())] == 1.0
    assert h[("weightsync_tensors_checked", (("kind", "param"),))] == 2.0  # weight and bias
    assert h[("weightsync_tensors_differing", (("kind", "param"),))] == 0.0
    assert h[("weightsync_max_abs_diff", ())] == 0.0
    assert not [k for k in h if k[0] == "weightsync_diverged_rank"]
    assert d[("weightsync_in_sync", ())] == 0.0 and d[("weightsync_step", ())] == 2.0
    assert d[("weightsync_tensors_differing", (("kind", "param"),))] == 1.0
    assert d[("weightsync_tensors_differing", (("kind", "optimizer"),))] == 0.0
    assert d[("weightsync_max_abs_diff", ())] == pytest.approx(PLANTED)
    assert d[("weightsync_audits_total", ())] == 2.0 and d[("weightsync_diverged_audits_total", ())] == 1.0
    assert d[("weightsync_audit_duration_seconds_count", ())] == 2.0
    assert d[("weightsync_audit_duration_seconds_sum", ())] > 0
    [(_name, labels)] = [k for k in d if k[0] == "weightsync_diverged_rank"]
    assert dict(labels)["rank"] == "1" and dict(labels)["host"] == socket.gethostname()
    assert dict(labels)["device"].startswith("cpu pid=")
    # The textfile (node_exporter's collector) holds what the endpoint served after the last record.
    text = (tmp_path / "rank0.prom").read_text()
    assert "weightsync_in_sync 0.0" in text and 'weightsync_diverged_rank{device="cpu pid=' in text


def _otel_rank(rank: int, world: int) -> dict[str, Any]:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from prometheus_client import CollectorRegistry, start_http_server

    from weightsync_audit.metrics import OpenTelemetrySink

    memory = InMemoryMetricReader()
    registry = CollectorRegistry()
    provider = MeterProvider(metric_readers=[memory, PrometheusMetricReader(registry=registry)])
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry) if rank == 0 else (None, None)
    model, opt = _model()
    audit = LoopAudit(model, opt, every_n_steps=1, verbose=False, sinks=[OpenTelemetrySink(meter_provider=provider)])
    audit.step(1)
    if rank == 1:
        with torch.no_grad():
            model.bias[2] -= PLANTED
    audit.step(2)
    audit.step(3)  # rank 1 stays apart
    points: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    for rm in memory.get_metrics_data().resource_metrics if memory.get_metrics_data() else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    value = p.value if hasattr(p, "value") else (p.count, p.sum)
                    points.setdefault(m.name, []).append((dict(p.attributes or {}), value))
    scraped = scrape(f"http://127.0.0.1:{server.server_port}/metrics") if server else None
    if server:
        server.shutdown()
    audit.close()
    provider.shutdown()
    return {"points": points, "scraped": scraped}


def test_opentelemetry_instruments_carry_the_figures_in_memory_and_through_its_prometheus_exporter() -> None:
    pytest.importorskip("opentelemetry.sdk")
    pytest.importorskip("opentelemetry.exporter.prometheus")
    r0, r1 = run_ranks(_otel_rank, 2)
    assert r1["points"] == {}  # rank 1 records nothing
    p = r0["points"]
    assert p["weightsync.in_sync"] == [({}, 0)] and p["weightsync.step"] == [({}, 3)]
    assert ({"kind": "param"}, 1) in p["weightsync.tensors.differing"]
    assert ({"kind": "param"}, 2) in p["weightsync.tensors.checked"]
    assert p["weightsync.gap.max_abs"][0][1] == pytest.approx(PLANTED)
    assert p["weightsync.audits"] == [({}, 3)] and p["weightsync.audits.diverged"] == [({}, 2)]
    [(_count_sum_attrs, (count, total))] = p["weightsync.audit.duration"]
    assert count == 3 and total > 0
    [(attrs, one)] = p["weightsync.diverged_rank"]
    assert attrs["rank"] == "1" and attrs["host"] == socket.gethostname() and one == 1
    s = r0["scraped"]
    assert s[("weightsync_in_sync", ())] == 0.0
    assert s[("weightsync_tensors_differing", (("kind", "param"),))] == 1.0
    assert s[("weightsync_audits_total", ())] == 3.0
    assert s[("weightsync_audit_duration_seconds_bucket", (("le", "60.0"),))] == 3.0  # the seconds buckets


def test_a_rank_named_once_goes_back_to_0_when_the_replicas_agree_again() -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from weightsync_audit.metrics import OpenTelemetrySink

    reader = InMemoryMetricReader()
    otel = OpenTelemetrySink(meter_provider=MeterProvider(metric_readers=[reader]))
    prom = PrometheusSink()
    apart = AuditResult(
        in_sync=False,
        step=5,
        mismatches=[Mismatch("w", "param", [1], [0], max_abs_diff=None)],
        hosts={"1": "n7 cpu pid=9"},
    )
    for sink in (otel, prom):
        sink.write(apart)
        sink.write(AuditResult(in_sync=True, step=6))
    assert (
        prom.registry.get_sample_value("weightsync_diverged_rank", {"rank": "1", "host": "n7", "device": "cpu pid=9"})
        is None
    )
    [metric] = [
        m
        for m in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
        if m.name == "weightsync.diverged_rank"
    ]
    assert [(dict(p.attributes), p.value) for p in metric.data.data_points] == [
        ({"rank": "1", "host": "n7", "device": "cpu pid=9"}, 0)
    ]


def test_the_blamed_rank_and_its_host_are_exported_with_the_evidence_and_cleared_when_in_sync() -> None:
    """The host to drain (the record's ``blame``, docs/report-schema.md) reaches Prometheus and OpenTelemetry;
    an undecided blame (a tie of two replicas) names no rank."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from weightsync_audit.metrics import OpenTelemetrySink

    reader = InMemoryMetricReader()
    otel = OpenTelemetrySink(meter_provider=MeterProvider(metric_readers=[reader]))
    prom = PrometheusSink()
    hosts = {"0": "n3 cuda:0 GPU-a", "1": "n7 cuda:1 GPU-b"}
    blamed = AuditResult(
        in_sync=False,
        step=7,
        mismatches=[Mismatch("w", "param", [1], [0], max_abs_diff=1e-3)],
        hosts=hosts,
        blame={"ranks": [0], "evidence": "at_rest_change", "hardware_suspect": True},
    )
    labels = {"rank": "0", "host": "n3", "device": "cuda:0 GPU-a", "evidence": "at_rest_change"}
    for sink in (otel, prom):
        sink.write(blamed)
    # The blame names rank 0 although the vote's odd one is rank 1: the exporters follow the blame.
    assert prom.registry.get_sample_value("weightsync_blamed_rank", {**labels, "hardware_suspect": "true"}) == 1
    assert record_figures(blamed).ranks[0].rank == 1
    undecided = AuditResult(
        in_sync=False, step=8, mismatches=blamed.mismatches, hosts=hosts, blame={"ranks": [], "evidence": "undecided"}
    )
    for sink in (otel, prom):
        sink.write(undecided)
    assert prom.registry.get_sample_value("weightsync_blamed_rank", {**labels, "hardware_suspect": "true"}) is None
    [metric] = [
        m
        for m in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
        if m.name == "weightsync.blamed_rank"
    ]
    assert [(dict(p.attributes), p.value) for p in metric.data.data_points] == [
        ({**labels, "hardware_suspect": "true"}, 0)
    ]


def test_a_divergence_whose_gap_was_not_measured_reads_nan_not_zero() -> None:
    f = record_figures(AuditResult(in_sync=False, mismatches=[Mismatch("w", "structure", [1], [0])]))
    assert math.isnan(f.max_abs_diff) and f.differing["structure"] == 1 and f.ranks[0].host == "unknown"


def test_a_failing_sink_warns_once_and_never_ends_the_run() -> None:
    class Broken:
        calls = 0

        def write(self, record: AuditResult) -> None:
            self.calls += 1
            raise OSError("collector unreachable")

    broken = Broken()
    sinks = RecordSinks([broken])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sinks.write(AuditResult(in_sync=True, step=1))
        sinks.write(AuditResult(in_sync=True, step=2))
    assert broken.calls == 2
    assert [str(w.message) for w in seen if issubclass(w.category, WeightSyncWarning)] == [
        "weightsync audit: the record sink Broken failed on the record of step 1 (OSError: collector unreachable); "
        "training goes on and the next record is offered to it again"
    ]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"port": 70000}, "port=70000"),
        ({"port": True}, "port=True"),
        ({"namespace": "weight-sync"}, "namespace='weight-sync'"),
        ({"textfile": "/nonexistent-dir/x.prom"}, "textfile='/nonexistent-dir/x.prom'"),
    ],
)
def test_bad_exporter_options_are_refused_at_construction_naming_the_argument(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[")):
        PrometheusSink(**kwargs)


def test_sinks_that_are_not_sinks_are_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match=r"sinks\[0\]=<built-in function print>"):
        LoopAudit(torch.nn.Linear(2, 2), sinks=[print])
    with pytest.raises(ValueError, match="sinks='prometheus'"):
        LoopAudit(torch.nn.Linear(2, 2), sinks="prometheus")


def test_without_the_extras_the_package_loop_audit_and_sinks_still_import_and_the_error_names_the_extra() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for name in ('prometheus_client', 'opentelemetry', 'ray'):\n"
        "    sys.modules[name] = None  # as if not installed\n"
        "import torch, weightsync_audit, weightsync_audit.metrics, weightsync_audit.integrations.ray_train\n"
        "from weightsync_audit import LoopAudit\n"
        "print(LoopAudit(torch.nn.Linear(2, 2), every_n_steps=1, verbose=False).step(1).in_sync)\n"
        "for name in ('PrometheusSink', 'OpenTelemetrySink'):\n"
        "    try:\n"
        "        getattr(weightsync_audit.metrics, name)\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "True",
        "weightsync_audit.metrics.PrometheusSink needs prometheus_client, the extra weightsync-audit[prometheus] (docs/metrics.md)",
        "weightsync_audit.metrics.OpenTelemetrySink needs opentelemetry, the extra weightsync-audit[otel] (docs/metrics.md)",
    ]


def test_the_lightning_and_hf_callbacks_hand_every_record_to_their_sinks(tmp_path: Path) -> None:
    import os

    import pytorch_lightning as pl
    from lightning_helpers import SmallModel, loader

    from weightsync_audit import WeightSyncAudit, read_report

    sink = PrometheusSink()
    report = tmp_path / "pl.jsonl"
    audit = WeightSyncAudit(every_n_train_steps=2, report_path=str(report), verbose=False, sinks=[sink])
    trainer = pl.Trainer(
        max_steps=4, accelerator="cpu", devices=1, callbacks=[audit], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(SmallModel(), train_dataloaders=loader())
    records = read_report(report).records
    assert sink.registry.get_sample_value("weightsync_audits_total") == len(records) >= 3
    assert sink.registry.get_sample_value("weightsync_step") == records[-1][1].step

    pytest.importorskip("transformers")
    os.environ.setdefault("WANDB_DISABLED", "true")
    from weightsync_audit.transformers import WeightSyncAuditCallback

    hf_sink = PrometheusSink()
    hf_report = tmp_path / "hf.jsonl"
    callback = WeightSyncAuditCallback(every_n_steps=2, report_path=str(hf_report), verbose=False, sinks=[hf_sink])
    tiny_trainer(tmp_path / "out", [callback], rows=8, max_steps=4, per_device_train_batch_size=2).train()
    hf_records = read_report(hf_report).records
    assert hf_sink.registry.get_sample_value("weightsync_audits_total") == len(hf_records) >= 2
    assert hf_sink.registry.get_sample_value("weightsync_in_sync") == 1.0
