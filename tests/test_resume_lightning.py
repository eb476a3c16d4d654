"""Resume fidelity through a real Lightning Trainer (2 CPU ranks, ddp_fork): a checkpoint at step 4, then
resumes that restore each rank's own state, rank 0's RNG on rank 1 with the lr scheduler left at its start,
and the fit loop's position lost. The faults are planted in ``on_load_checkpoint``; the truth is the plant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from tests.lightning_helpers import SmallModel, fit, records
from weightsync_audit import WeightSyncAudit
from weightsync_audit.engine.checkpoints.sidecar import read_sidecar


class _PerRankRng(SmallModel):
    """Each rank its own RNG stream, saved in its own file beside the checkpoint and restored from it."""

    def __init__(self, folder: Path, fault: str = "") -> None:
        super().__init__()
        self.folder, self.fault = folder, fault

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def on_train_start(self) -> None:
        if not self.trainer.ckpt_path:
            torch.manual_seed(100 + self.trainer.global_rank)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        torch.save(torch.get_rng_state(), self.folder / f"rng{self.trainer.global_rank}.pt")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        rank = self.trainer.global_rank
        own = 0 if self.fault == "rng_and_scheduler" else rank  # rank 1's RNG file replaced by rank 0's
        torch.set_rng_state(torch.load(self.folder / f"rng{own}.pt", weights_only=True))
        if self.fault == "rng_and_scheduler":  # the lr scheduler re-created, not restored
            checkpoint["lr_schedulers"][0].update(last_epoch=0, _step_count=1, _last_lr=[0.1])
        if self.fault == "position":  # the fit loop's state lost: the run starts its data over
            checkpoint.pop("loops")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("lightning_resume")
    report, ckpt_dir = tmp / "audit.jsonl", tmp / "ckpt"
    ckpt_dir.mkdir()
    audit = dict(every_n_train_steps=None, hooks=(), report_path=str(report))
    every4 = ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=4, save_top_k=-1, filename="s{step}")
    fit(tmp, _PerRankRng(ckpt_dir), [WeightSyncAudit(**audit), every4], enable_checkpointing=True, max_steps=4)
    [ckpt] = sorted(ckpt_dir.glob("*.ckpt"))
    out: dict[str, Any] = {"saved": records(report)[-1], "sidecar": read_sidecar(ckpt)}
    for fault in ("", "rng_and_scheduler", "position"):
        before = len(records(report))
        model = _PerRankRng(ckpt_dir, fault)
        fit(tmp, model, [WeightSyncAudit(**audit)], max_steps=5, ckpt_path=str(ckpt))
        out[fault or "clean"] = records(report)[before]
    return out


def _details(record: dict[str, Any]) -> list[str]:
    return [f["detail"] for f in record["checkpoint"]["resume"]["findings"]]


def test_the_sidecar_holds_every_ranks_resume_state(resumed: dict[str, Any]) -> None:
    ranks = resumed["sidecar"]["resume"]["ranks"]
    assert sorted(ranks) == ["0", "1"]
    assert ranks["0"]["rng.torch"] != ranks["1"]["rng.torch"]  # each rank its own stream
    assert ranks["0"]["lr_scheduler"] == ranks["1"]["lr_scheduler"]  # one schedule on every replica
    assert ranks["0"]["data.position"]["value"] == {"step": 4, "epoch": 0}
    assert resumed["saved"]["checkpoint"]["resume"]["status"] == "recorded"


def test_a_clean_lightning_resume_is_exact(resumed: dict[str, Any]) -> None:
    clean = resumed["clean"]
    assert clean["hook"] == "on_train_start" and clean["checkpoint"]["status"] == "matching"
    assert (clean["checkpoint"]["resume"]["status"], _details(clean)) == ("exact", [])


def test_rank_0s_rng_on_rank_1_and_a_scheduler_at_its_start_are_each_named(resumed: dict[str, Any]) -> None:
    record = resumed["rng_and_scheduler"]
    assert record["checkpoint"]["resume"]["status"] == "differs"
    assert sorted(_details(record)) == [
        "rank 1 resumed with rank 0's torch RNG state",
        "the lr scheduler restarted at step 0 (saved at step 4) on every rank",
    ]
    assert any(n == "resume: rank 1 resumed with rank 0's torch RNG state" for n in record["notes"])


def test_a_lost_fit_loop_position_restarts_the_data_at_step_0(resumed: dict[str, Any]) -> None:
    assert "the data position restarted at step 0 (saved at step 4) on every rank" in _details(resumed["position"])
