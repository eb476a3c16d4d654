"""Zero-code activation: ``WEIGHTSYNC_AUDIT`` adds the callback to real Trainers through Lightning's entry points."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as lp
import pytest
import pytorch_lightning as pl
import torch

from weightsync_audit.errors import WeightSyncWarning
from weightsync_audit.integrations.activation import ENV_VAR, parse_options
from weightsync_audit.lightning import lightning_pytorch as lp_ns
from weightsync_audit.lightning import pytorch_lightning as pl_ns

NAMESPACES = [(pl, pl_ns.WeightSyncAudit), (lp, lp_ns.WeightSyncAudit)]
IDS = ["pytorch_lightning", "lightning.pytorch"]


def _trainer(mod: Any, **kw: Any) -> Any:
    return mod.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def _audits(trainer: Any) -> list[Any]:
    return [cb for cb in trainer.callbacks if type(cb).__name__ == "WeightSyncAudit"]


@pytest.mark.parametrize(("mod", "cls"), NAMESPACES, ids=IDS)
def test_set_to_1_adds_the_callback_with_defaults(monkeypatch: pytest.MonkeyPatch, mod: Any, cls: type) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    found = _audits(_trainer(mod))
    assert len(found) == 1
    assert type(found[0]) is cls  # the class of the Trainer's own namespace
    assert found[0].every_n_train_steps == 100 and found[0].on_mismatch == "warn"


@pytest.mark.parametrize(("mod", "cls"), NAMESPACES, ids=IDS)
@pytest.mark.parametrize("value", [None, "0", "", "off"])
def test_unset_or_off_adds_nothing(monkeypatch: pytest.MonkeyPatch, mod: Any, cls: type, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)
    assert _audits(_trainer(mod)) == []


@pytest.mark.parametrize(("mod", "cls"), NAMESPACES, ids=IDS)
def test_options_reach_the_callback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mod: Any, cls: type) -> None:
    report = tmp_path / "audit.jsonl"
    monkeypatch.setenv(
        ENV_VAR,
        f"every_n_train_steps=50,on_mismatch=raise,report_path={report},hooks=on_train_start+on_fit_end,timeout_s=30",
    )
    (cb,) = _audits(_trainer(mod))
    assert cb.every_n_train_steps == 50
    assert cb.on_mismatch == "raise"
    assert cb.report_path == str(report)
    assert cb.hooks == ("on_train_start", "on_fit_end")
    assert cb.timeout_s == 30.0


@pytest.mark.parametrize(("mod", "cls"), NAMESPACES, ids=IDS)
@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("every_n_train_step=5", "every_n_train_step"),  # a typo in the name
        ("on_mismatch=explode", "on_mismatch"),
        ("every_n_train_steps=often", "every_n_train_steps"),
        ("hooks=on_nothing", "hooks"),
        ("timeout_s=soon", "timeout_s"),
        ("verbose", "verbose"),  # not key=value
        ("report_path=/nonexistent-dir/audit.jsonl", "report_path"),
    ],
)
def test_a_bad_option_fails_trainer_construction_naming_it(
    monkeypatch: pytest.MonkeyPatch, mod: Any, cls: type, value: str, named: str
) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(ValueError, match=ENV_VAR) as info:
        _trainer(mod)
    assert named in str(info.value)


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_real_fit_writes_the_report_without_a_code_change(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    report = tmp_path / "audit.jsonl"
    monkeypatch.setenv(ENV_VAR, f"every_n_train_steps=2,report_path={report},verbose=false")
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    trainer = _trainer(pl, max_steps=4)
    trainer.fit(_Tiny(), data)
    records = [json.loads(line) for line in report.read_text().splitlines()]
    assert [r["hook"] for r in records] == [
        "on_train_start",
        "on_train_batch_end",
        "on_train_batch_end",
        "on_train_epoch_end",
    ]
    assert all(r["in_sync"] and r["schema"] == "weightsync-audit/1" for r in records)

    from weightsync_audit.cli import main

    assert main(["check", str(report)]) == 0


def test_an_explicit_callback_wins_over_the_variable_which_warns_naming_its_dropped_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env_report, own_report = tmp_path / "env.jsonl", tmp_path / "own.jsonl"
    monkeypatch.setenv(ENV_VAR, f"every_n_train_steps=1,report_path={env_report},verbose=false")
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    own = pl_ns.WeightSyncAudit(every_n_train_steps=2, report_path=str(own_report), verbose=False)
    trainer = _trainer(pl, max_steps=4, callbacks=[own])
    assert len(_audits(trainer)) == 2
    with pytest.warns(WeightSyncWarning, match="WeightSyncAudit passed in callbacks") as said:
        trainer.fit(_Tiny(), data)
    [dropped] = [str(w.message) for w in said if "are dropped" in str(w.message)]
    assert f"every_n_train_steps=1, report_path='{env_report}', verbose=False are dropped" in dropped
    assert not env_report.exists()
    assert len(own_report.read_text().splitlines()) == 4
    [env_cb] = [c for c in _audits(trainer) if c is not own]
    assert "already has a WeightSyncAudit" in env_cb.summary()


def test_parse_options_examples() -> None:
    assert parse_options(None) is None
    assert parse_options(" 1 ") == {}
    assert parse_options("every_n_train_steps=none,exclude=*.running_*+head.*") == {
        "every_n_train_steps": None,
        "exclude": ("*.running_*", "head.*"),
    }
