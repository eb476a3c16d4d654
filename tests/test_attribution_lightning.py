"""Attribution with the Lightning callback (a real Trainer, ddp_fork, 2 CPU ranks, Adam): a bit flipped at
rest and a one-ulp fault in one rank's update are each blamed on the right rank, with the right class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
from attribution_faults import FaultyAdam, flip_bit
from lightning_helpers import Perturb, SmallModel, fit, records

from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit


class FaultyModel(SmallModel):
    """Adam whose update on ``rank`` at its ``at``-th step is off by one ulp in one element."""

    def __init__(self, rank: int, at: int) -> None:
        super().__init__(optimizer="adam")
        self.fault_rank, self.fault_at = rank, at

    def configure_optimizers(self) -> Any:
        opt = FaultyAdam(self.parameters(), lr=1e-2)
        opt.fault_at = self.fault_at if self.trainer.global_rank == self.fault_rank else None
        return opt


def _flip(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    flip_bit(next(module.parameters()), 5, 27)


@pytest.mark.parametrize(
    ("fault", "rank", "evidence"),
    [("flip", 0, "at_rest_change"), ("flip", 1, "at_rest_change"), ("ulp", 1, "update_not_reproducible")],
)
def test_lightning_names_the_faulty_rank_and_its_class(tmp_path: Path, fault: str, rank: int, evidence: str) -> None:
    report = tmp_path / "audit.jsonl"
    audit = WeightSyncAudit(every_n_train_steps=1, report_path=str(report), verbose=False, attribution=True)
    if fault == "flip":
        model, callbacks = SmallModel(optimizer="adam"), [Perturb(rank, 3, _flip), audit]
    else:
        model, callbacks = FaultyModel(rank, 4), [audit]
    fit(tmp_path, model, callbacks, max_epochs=1, limit_train_batches=6)
    bad = [r for r in records(report) if not r["in_sync"]]
    assert bad, "the fault was not seen"
    blame = bad[0]["blame"]
    assert blame["ranks"] == [rank] and blame["evidence"] == evidence and blame["hardware_suspect"], blame
    assert any("tie vote" in (m["detail"] or "") for m in bad[0]["mismatches"])


class _FlipOnce(pl.Callback):
    """On ``rank``, the first time ``global_step`` is ``step`` at a batch's end: one bit flipped at rest."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step, self.done = rank, step, False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.done and trainer.global_rank == self.rank and trainer.global_step == self.step:
            self.done = True
            flip_bit(next(pl_module.parameters()), 5, 27)


def test_lightning_gradient_accumulation_marks_each_step_once_and_names_the_flipped_rank(tmp_path: Path) -> None:
    """``accumulate_grad_batches=2``: two batches end under each ``global_step``; the second is no optimizer step
    and must leave the step's record as it is. A bit flipped on rank 1 right after step 2 is found at rest before
    step 3 (the audit every 4 steps sees it only through the records)."""
    report = tmp_path / "audit.jsonl"
    audit = WeightSyncAudit(every_n_train_steps=4, report_path=str(report), verbose=False, attribution=True)
    fit(tmp_path, SmallModel(optimizer="adam"), [_FlipOnce(1, 2), audit], max_epochs=1, limit_train_batches=10,
        accumulate_grad_batches=2)  # fmt: skip
    bad = [r for r in records(report) if not r["in_sync"]]
    assert bad, "the flip was not seen"
    blame = bad[0]["blame"]
    assert (blame["ranks"], blame["evidence"], blame["step"]) == ([1], "at_rest_change", 3), blame
    assert blame["hardware_suspect"] is True
