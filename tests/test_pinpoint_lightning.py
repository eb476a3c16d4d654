"""Pinpoint and tolerance through the Lightning callback, on real 2-rank ``ddp_fork`` Trainers."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
from lightning_helpers import Perturb, SmallModel, fit, records

from weightsync_audit.cli.lightning_20340 import UNFREEZE_EPOCH, SeedModel, make_loader
from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit

FIRST_STEP_OF_EPOCH_3 = 49  # 16 optimizer steps an epoch on 2 ranks; global_step after the step


def test_lightning_20340_audited_every_16_steps_is_pinpointed_to_step_49(tmp_path: Path) -> None:
    report = tmp_path / "audit.jsonl"
    audit = WeightSyncAudit(every_n_train_steps=16, pinpoint=True, report_path=str(report), verbose=False)
    fit(
        tmp_path,
        SeedModel(),
        [audit, pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE_EPOCH)],
        max_epochs=4,
        data=make_loader(0),
    )
    recs = records(report)
    first_bad = next(r for r in recs if not r["in_sync"])
    # No audit ran at step 48 or 49: the in-sync audit before was at 48 by the cadence, the divergent
    # one at 64; the per-step digests say exactly where between them the replicas parted.
    assert (first_bad["step"], first_bad["epoch"]) == (64, 3)
    assert (first_bad["pinpoint"], first_bad["first_diverged_step"], first_bad["last_in_sync_step"]) == (
        "exact",
        FIRST_STEP_OF_EPOCH_3,
        FIRST_STEP_OF_EPOCH_3 - 1,
    )
    assert all(r["in_sync"] for r in recs if r["step"] < 64)
    assert [m["name"] for m in first_bad["mismatches"]] == ["backbone.weight", "backbone.bias"]
    assert "DistributedDataParallel does not all-reduce" in first_bad["hints"][0]


def _scale_weight(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    module.net[0].weight.mul_(1 + 2e-7)


def _jump_bias(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    module.net[2].bias[0] += 0.01


def test_callback_with_raise_and_a_tolerance_raises_only_for_the_jump_beyond_it(tmp_path: Path) -> None:
    report = tmp_path / "audit.jsonl"
    audit = WeightSyncAudit(
        every_n_train_steps=1, on_mismatch="raise", tolerance=1e-5, report_path=str(report), verbose=False
    )
    # The perturbations run before the audit at the same step (callbacks run in list order).
    cbs = [Perturb(1, 3, _scale_weight), Perturb(1, 6, _jump_bias), audit]
    with pytest.raises(Exception, match="WeightDivergenceError") as info:
        fit(tmp_path, SmallModel(), cbs, max_epochs=1)
    assert "net.2.bias" in str(info.value)
    recs = records(report)
    by_step = {r["step"]: r for r in recs if r["hook"] == "on_train_batch_end"}
    assert max(by_step) == 6
    for step in (3, 4, 5):  # the scaled weight differs, within the tolerance: recorded, not acted on
        r = by_step[step]
        assert (r["in_sync"], r["within_tolerance"], r["action"]) == (False, True, "none")
        [m] = r["mismatches"]
        assert m["name"] == "net.0.weight" and m["within_tolerance"] and m["rel_diff"] < 1e-5
    r = by_step[6]
    assert (r["within_tolerance"], r["action"]) == (False, "raised")
    beyond = [m["name"] for m in r["mismatches"] if not m["within_tolerance"]]
    assert beyond == ["net.2.bias"]
