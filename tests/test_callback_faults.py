"""The callback never ends the user's run under on_mismatch="warn": a full disk, a failed audit, a big
divergence (real Trainers on 2 fork ranks)."""

from __future__ import annotations

import errno
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch
from lightning_helpers import Perturb, SmallModel, fit, rank_end, records
from torch import nn

from weightsync_audit import AuditResult, WeightSyncWarning
from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit
from weightsync_audit.reporting.jsonl import ReportWriter, read_report
from weightsync_audit.text import without_tie


def full_disk(fails: int) -> Callable[[ReportWriter, int, bytes], None]:
    """Stands in for the disk under ``report_path``: the first ``fails`` writes raise ENOSPC, each after
    writing half its line (as a real disk may)."""
    real = ReportWriter._write_line
    left = [fails]

    def write_line(writer: ReportWriter, fd: int, data: bytes) -> None:
        if left[0] > 0:
            left[0] -= 1
            real(writer, fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(writer, fd, data)

    return write_line


def test_report_writer_keeps_records_while_the_disk_is_full_and_writes_them_in_order_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ReportWriter, "_write_line", full_disk(3))
    path = tmp_path / "audit.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = ReportWriter(path, keep_on_error=True)
        for step in range(5):
            w.write(AuditResult(in_sync=True, step=step))
            assert w.kept == (step + 1 if step < 3 else 0)
        w.close()
    full = [c for c in caught if "cannot write the report" in str(c.message)]
    assert len(full) == 1 and issubclass(full[0].category, WeightSyncWarning), "warns once"
    contents = read_report(path)
    assert not contents.errors, "no torn line is left behind"
    assert [r.step for _, r in contents.records] == [0, 1, 2, 3, 4]


def test_report_writer_keeps_records_while_its_directory_is_removed(tmp_path: Path) -> None:
    d = tmp_path / "reports"
    d.mkdir()
    path = d / "audit.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = ReportWriter(path, keep_on_error=True)
        w.write(AuditResult(in_sync=True, step=0))
        w.close()
        path.unlink()
        d.rmdir()
        w.write(AuditResult(in_sync=True, step=1))
        assert w.kept == 1
        d.mkdir()
        w.write(AuditResult(in_sync=True, step=2))
        w.close()
    assert [r.step for _, r in read_report(path).records] == [1, 2]


def test_a_full_disk_under_report_path_does_not_end_training_and_records_return_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ReportWriter, "_write_line", full_disk(4))  # inherited by the forked ranks
    report = tmp_path / "audit.jsonl"
    fit(tmp_path, SmallModel(), [WeightSyncAudit(every_n_train_steps=1, report_path=str(report))], max_epochs=1)
    assert rank_end(tmp_path, 0)["ended"] == rank_end(tmp_path, 1)["ended"] == "ok"
    steps = [r["step"] for r in records(report) if r["hook"] == "on_train_batch_end"]
    assert steps == list(range(1, 9)), "every record, the kept ones first, in order"


class FailedAuditProbe(pl.Callback):
    """Rank 1 audits once more than rank 0 at step 2 (out of step: the channel breaks); at the end each
    rank writes what the callback noted."""

    def __init__(self, out: Path, audit: WeightSyncAudit) -> None:
        self.out, self.audit = out, audit

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 2:
            self.audit._run(trainer, "on_validation_start")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        notes = {"failures": self.audit.runner.failures, "step": trainer.global_step}
        (self.out / f"notes{trainer.global_rank}.json").write_text(json.dumps(notes))


def test_a_failed_audit_under_warn_is_reported_and_training_goes_on_and_later_audits_say_the_channel_is_gone(
    tmp_path: Path,
) -> None:
    audit = WeightSyncAudit(every_n_train_steps=1, timeout_s=3)
    fit(tmp_path, SmallModel(), [FailedAuditProbe(tmp_path, audit), audit], max_epochs=1)
    assert rank_end(tmp_path, 0)["ended"] == rank_end(tmp_path, 1)["ended"] == "ok"
    for r in (0, 1):
        notes = json.loads((tmp_path / f"notes{r}.json").read_text())
        assert notes["step"] == 8
        assert "AuditOutOfStepError" in notes["failures"][0]
        assert "unusable after an earlier failure" in notes["failures"][-1]


class BigParam(SmallModel):
    def __init__(self, mib: int) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.zeros(mib << 18), requires_grad=False)


def _diverge_big(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    module.big[12345] += 0.5


def test_a_big_divergence_under_warn_is_measured_and_training_finishes(tmp_path: Path) -> None:
    report = tmp_path / "audit.jsonl"
    callbacks = [
        Perturb(1, 2, _diverge_big),
        WeightSyncAudit(every_n_train_steps=1, report_path=str(report), timeout_s=10),
    ]
    fit(tmp_path, BigParam(64), callbacks, max_epochs=1, limit_train_batches=4)
    assert rank_end(tmp_path, 0)["ended"] == rank_end(tmp_path, 1)["ended"] == "ok"
    bad = [r for r in records(report) if not r["in_sync"] and r["hook"] == "on_train_batch_end"]
    assert [r["step"] for r in bad] == [2, 3, 4]
    assert all(
        [(m["name"], m["max_abs_diff"], without_tie(m["detail"])) for m in r["mismatches"]] == [("big", 0.5, None)]
        for r in bad
    )
