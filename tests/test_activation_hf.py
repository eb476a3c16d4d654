"""``WEIGHTSYNC_AUDIT`` under the Hugging Face Trainer: ``WeightSyncAuditCallback.from_env()``, one line.

The Trainer has no entry point for callbacks (Lightning's ``callbacks_factory``), so the same variable is
read by a classmethod; real single-process Trainers, a tiny local model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("WANDB_DISABLED", "true")

from hf_setup import tiny_trainer

from weightsync_audit.errors import WeightSyncWarning
from weightsync_audit.integrations.activation import ENV_VAR
from weightsync_audit.transformers import WeightSyncAuditCallback


def _train(tmp_path: Path, callbacks: list[Any]) -> Any:
    trainer = tiny_trainer(
        tmp_path / "out", callbacks, rows=8, max_steps=4, per_device_train_batch_size=2, logging_steps=1
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("value", [None, "0", "", "off"])
def test_from_env_unset_or_off_gives_no_callback(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)
    assert WeightSyncAuditCallback.from_env() == []


def test_from_env_takes_the_variables_options_and_reads_the_lightning_cadence_as_every_n_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    [default] = WeightSyncAuditCallback.from_env()
    assert default.every_n_steps == 100 and default.runner.on_mismatch == "warn"
    monkeypatch.setenv(ENV_VAR, "every_n_train_steps=5,on_mismatch=raise,exit_code=17,checkpoints=false")
    [cb] = WeightSyncAuditCallback.from_env()
    assert cb.every_n_steps == 5 and cb.runner.on_mismatch == "raise" and cb.runner.exit_code == 17
    assert cb.checkpoints is False and cb.env_options == {
        "every_n_steps": 5,
        "on_mismatch": "raise",
        "exit_code": 17,
        "checkpoints": False,
    }


@pytest.mark.parametrize(
    ("value", "named"), [("hooks=on_train_start", "hooks"), ("on_mismatch=explode", "on_mismatch")]
)
def test_from_env_bad_option_raises_naming_it(monkeypatch: pytest.MonkeyPatch, value: str, named: str) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(ValueError, match=named):
        WeightSyncAuditCallback.from_env()


def test_from_env_in_a_real_trainer_writes_the_report(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    report = tmp_path / "audit.jsonl"
    monkeypatch.setenv(ENV_VAR, f"every_n_steps=2,report_path={report},verbose=false")
    _train(tmp_path, WeightSyncAuditCallback.from_env())
    records = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(r["hook"], r["step"]) for r in records] == [("on_train_begin", 0), ("on_step_end", 2), ("on_step_end", 4)]
    assert all(r["in_sync"] for r in records)


def test_from_env_next_to_an_explicit_callback_steps_aside_naming_its_dropped_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env_report, own_report = tmp_path / "env.jsonl", tmp_path / "own.jsonl"
    monkeypatch.setenv(ENV_VAR, f"every_n_steps=1,report_path={env_report},verbose=false")
    own = WeightSyncAuditCallback(every_n_steps=2, report_path=str(own_report), verbose=False)
    [env_cb] = WeightSyncAuditCallback.from_env()
    with pytest.warns(WeightSyncWarning, match="WeightSyncAuditCallback passed in callbacks") as said:
        _train(tmp_path, [env_cb, own])
    [dropped] = [str(w.message) for w in said if "are dropped" in str(w.message)]
    assert f"every_n_steps=1, report_path='{env_report}', verbose=False are dropped" in dropped
    assert not env_report.exists() and len(own_report.read_text().splitlines()) == 3
    assert "already has a WeightSyncAuditCallback" in env_cb.summary()
