"""Verified checkpoints through a real Lightning Trainer (2 CPU ranks, ddp_fork): sidecars at save, checked on resume."""

from __future__ import annotations

from pathlib import Path

from pytorch_lightning.callbacks import ModelCheckpoint

from tests.lightning_helpers import SmallModel, fit, records
from weightsync_audit import WeightSyncAudit
from weightsync_audit.cli import main
from weightsync_audit.engine.checkpoints.sidecar import read_sidecar


class _ResumedOnRank0Only(SmallModel):
    """Rank 1 restores other optimizer state than was saved (DDP's broadcast at wrap covers the weights)."""

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.trainer.global_rank == 1:
            for state in checkpoint["optimizer_states"][0]["state"].values():
                state["momentum_buffer"].add_(0.5)


def test_lightning_saves_verified_sidecars_and_a_resume_names_the_rank_that_loaded_something_else(
    tmp_path: Path,
) -> None:
    report, ckpt_dir = tmp_path / "audit.jsonl", tmp_path / "ckpt"
    fit(
        tmp_path,
        SmallModel(),
        [
            WeightSyncAudit(every_n_train_steps=None, hooks=(), report_path=str(report)),
            ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True),
        ],
        enable_checkpointing=True,
        max_epochs=1,
    )
    saved = records(report)
    assert saved and all(r["checkpoint"]["event"] == "saved" and r["checkpoint"]["status"] == "verified" for r in saved)
    ckpts = sorted(ckpt_dir.glob("*.ckpt"))
    for ckpt in ckpts:
        sidecar = read_sidecar(ckpt)
        assert sidecar is not None and sidecar["verdict"] == "verified" and sidecar["step"] == 8
        assert "state_dict.net.0.weight" in sidecar["tensors"]
        assert main(["verify", str(ckpt)]) == 0
    fit(
        tmp_path,
        _ResumedOnRank0Only(),
        [WeightSyncAudit(every_n_train_steps=None, hooks=(), report_path=str(report), checkpoints=True)],
        max_epochs=2,
        ckpt_path=str(ckpt_dir / "last.ckpt"),
    )
    start = records(report)[len(saved)]
    assert start["hook"] == "on_train_start" and start["step"] == 8
    assert start["checkpoint"]["event"] == "loaded" and start["checkpoint"]["status"] == "changed"
    named = {(m["name"], m["kind"], tuple(m["ranks"])) for m in start["mismatches"]}
    assert ("optimizer_states.0.state.0.momentum_buffer", "optimizer", (1,)) in named
    assert any("saved at step 8" in (m["detail"] or "") for m in start["mismatches"])
