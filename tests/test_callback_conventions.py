"""Lightning conventions of the callback: arguments checked once, a state key from the arguments, no
audit during the sanity check."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
from pytorch_lightning.demos.boring_classes import BoringModel

from weightsync_audit import WeightSyncAudit
from weightsync_audit.engine.config import AuditConfig
from weightsync_audit.reporting.jsonl import read_report


def test_two_callbacks_with_different_arguments_keep_their_state_apart() -> None:
    a = WeightSyncAudit(every_n_train_steps=10)
    b = WeightSyncAudit(every_n_train_steps=10, include=("params", "grads"))
    c = WeightSyncAudit(every_n_train_steps=10)
    assert a.state_key != b.state_key
    assert a.state_key == c.state_key  # a resumed run with the same arguments finds its history
    assert a.state_key.startswith("WeightSyncAudit{")
    assert a._legacy_state_key == "WeightSyncAudit"  # what version 0.1 saved its history under


def test_the_callback_holds_one_validated_config() -> None:
    cb = WeightSyncAudit(include=("params",), exclude="head.*", coverage="1/4", timeout_s=30)
    assert cb.config == AuditConfig(include=("params",), exclude=("head.*",), slices=4, timeout_s=30)
    with pytest.raises(ValueError, match="timeout_s"):
        WeightSyncAudit(timeout_s=True)


def test_the_sanity_check_is_not_audited(tmp_path: Path) -> None:
    report = tmp_path / "audit.jsonl"
    audit = WeightSyncAudit(every_n_train_steps=None, hooks=("on_validation_start",), report_path=report, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1, num_sanity_val_steps=1,
        val_check_interval=2, callbacks=[audit], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BoringModel())
    steps = [r.step for _, r in read_report(report).records]
    assert steps == [2], steps  # the validation at step 2 only; the sanity check at step 0 is not audited
