"""Resume fidelity through a real Lightning Trainer (2 CPU ranks, ddp_fork, 8 batches per rank and epoch): one
run of 2 epochs saves the default end-of-epoch checkpoints and one every 4 steps, recording the batches each
rank trains; then resumes: from the end of epoch 0 (Lightning's most common resume: exact, the truth is the
uninterrupted run's batches); from step 4 of 8 with a plain DataLoader (every rank trains steps 1-4's
batches again: named), with rank 0's RNG on rank 1 and the lr scheduler left at its start (planted in
``on_load_checkpoint``); with the fit loop's position lost; and an iteration-based run (``max_steps``) from
the end of epoch 0, which Lightning resumes inside epoch 0 (the truth: other batches than uninterrupted).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
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
        name = f"rng{self.trainer.global_rank}-{checkpoint['global_step']}.pt"
        torch.save(torch.get_rng_state(), self.folder / name)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        rank = self.trainer.global_rank
        own = 0 if self.fault == "rng_and_scheduler" else rank  # rank 1's RNG file replaced by rank 0's
        torch.set_rng_state(torch.load(self.folder / f"rng{own}-{checkpoint['global_step']}.pt", weights_only=True))
        if self.fault == "rng_and_scheduler":  # the lr scheduler re-created, not restored
            checkpoint["lr_schedulers"][0].update(last_epoch=0, _step_count=1, _last_lr=[0.1])
        if self.fault == "position":  # the fit loop's state lost: the run starts its data over
            checkpoint.pop("loops")


class _Batches(pl.Callback):
    """Each rank's batches, by the optimizer step they train (``batches-<tag>.rank<r>.json``): the truth."""

    def __init__(self, out: Path, tag: str) -> None:
        self.out, self.tag, self.seen = out, tag, {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen[trainer.global_step + 1] = batch.double().sum().item()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        (self.out / f"batches-{self.tag}.rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


RESUMES = {  # name -> (checkpoint, fault, the Trainer's stop)
    "clean": ("epoch", "", {"max_epochs": 2}),
    "mid_epoch": ("s4", "rng_and_scheduler", {"max_epochs": 1}),
    "position": ("epoch", "position", {"max_steps": 2}),
    "iteration": ("epoch", "", {"max_steps": 10, "max_epochs": -1}),
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("lightning_resume")
    report, ckpt_dir = tmp / "audit.jsonl", tmp / "ckpt"
    ckpt_dir.mkdir()
    audit = dict(every_n_train_steps=None, hooks=(), report_path=str(report))
    every_epoch = ModelCheckpoint(dirpath=str(ckpt_dir / "epoch"), save_top_k=-1)  # the default: epoch=0-step=8.ckpt
    every4 = ModelCheckpoint(dirpath=str(ckpt_dir / "steps"), every_n_train_steps=4, save_top_k=-1, filename="s{step}")
    callbacks = [WeightSyncAudit(**audit), every_epoch, every4, _Batches(tmp, "full")]
    fit(tmp, _PerRankRng(ckpt_dir), callbacks, enable_checkpointing=True, max_epochs=2)
    ckpts = {"epoch": ckpt_dir / "epoch" / "epoch=0-step=8.ckpt", "s4": ckpt_dir / "steps" / "sstep=4.ckpt"}
    out: dict[str, Any] = {"sidecar": {k: read_sidecar(p) for k, p in ckpts.items()}, "batches": {}}
    out["saved"] = next(r for r in records(report) if r["checkpoint"]["path"] == str(ckpts["s4"]))
    for name, (ckpt, fault, stop) in RESUMES.items():
        before = len(records(report))
        model = _PerRankRng(ckpt_dir, fault)
        fit(tmp, model, [WeightSyncAudit(**audit), _Batches(tmp, name)], ckpt_path=str(ckpts[ckpt]), **stop)
        out[name] = records(report)[before]
    for tag in ("full", *RESUMES):
        out["batches"][tag] = [
            {int(k): v for k, v in json.loads((tmp / f"batches-{tag}.rank{r}.json").read_text()).items()}
            for r in (0, 1)
        ]
    return out


def _details(record: dict[str, Any]) -> list[str]:
    return [f["detail"] for f in record["checkpoint"]["resume"]["findings"]]


def test_the_sidecar_holds_every_ranks_resume_state(resumed: dict[str, Any]) -> None:
    ranks = resumed["sidecar"]["s4"]["resume"]["ranks"]
    assert sorted(ranks) == ["0", "1"]
    assert ranks["0"]["rng.torch"] != ranks["1"]["rng.torch"]  # each rank its own stream
    assert ranks["0"]["lr_scheduler"] == ranks["1"]["lr_scheduler"]  # one schedule on every replica
    assert ranks["0"]["data.position"]["value"] == {"step": 4, "epoch": 0, "batch": 4}  # next: batch 4 of epoch 0
    at_epoch_end = resumed["sidecar"]["epoch"]["resume"]["ranks"]["0"]["data.position"]["value"]
    assert at_epoch_end == {"step": 8, "epoch": 1, "batch": 0}  # next: epoch 1's first batch
    assert resumed["saved"]["checkpoint"]["resume"]["status"] == "recorded"


def test_a_resume_from_the_default_end_of_epoch_checkpoint_is_exact(resumed: dict[str, Any]) -> None:
    full, got = resumed["batches"]["full"], resumed["batches"]["clean"]
    for r in (0, 1):  # the truth: every rank trains the uninterrupted run's batches of steps 9-16
        assert sorted(got[r]) == list(range(9, 17)) and got[r] == {s: full[r][s] for s in range(9, 17)}
    clean = resumed["clean"]
    assert clean["hook"] == "on_train_start" and clean["checkpoint"]["status"] == "matching"
    assert (clean["checkpoint"]["resume"]["status"], _details(clean)) == ("exact", [])


def test_a_mid_epoch_resume_with_a_plain_dataloader_rank_0s_rng_on_rank_1_and_a_scheduler_at_its_start_are_named(
    resumed: dict[str, Any],
) -> None:
    full, got = resumed["batches"]["full"], resumed["batches"]["mid_epoch"]
    for r in (0, 1):  # the truth: steps 5-8 train the batches of steps 1-4 again, on every rank
        assert (
            [got[r][s] for s in range(5, 9)] == [full[r][s] for s in range(1, 5)] != [full[r][s] for s in range(5, 9)]
        )
    record = resumed["mid_epoch"]
    assert record["checkpoint"]["resume"]["status"] == "differs"
    assert _details(record) == [
        "rank 1 resumed with rank 0's torch RNG state",
        "the data position restarted at batch 0 (saved at batch 4) on every rank: Lightning cannot restore a "
        "DataLoader without state_dict() mid-epoch: it starts epoch 0's data over while counting on from batch 4, "
        "so every rank trains that epoch's first 4 batches again (resume from an end-of-epoch checkpoint, or give "
        "the loader state_dict() and load_state_dict())",
        "the lr scheduler restarted at step 0 (saved at step 4) on every rank",
    ]
    assert any(n == "resume: rank 1 resumed with rank 0's torch RNG state" for n in record["notes"])


def test_a_lost_fit_loop_position_restarts_the_data_at_step_0(resumed: dict[str, Any]) -> None:
    full, got = resumed["batches"]["full"], resumed["batches"]["position"]
    assert all(got[r][1] == full[r][1] for r in (0, 1))  # the truth: the data starts over
    assert "the data position restarted at step 0 (saved at step 8) on every rank" in _details(resumed["position"])


def test_an_iteration_based_run_resumed_from_an_epochs_end_is_named(resumed: dict[str, Any]) -> None:
    full, got = resumed["batches"]["full"], resumed["batches"]["iteration"]
    for r in (0, 1):  # the truth: steps 9-10 train other batches than the uninterrupted run's
        assert sorted(got[r]) == [9, 10] and [got[r][s] for s in (9, 10)] != [full[r][s] for s in (9, 10)]
    record = resumed["iteration"]
    assert record["checkpoint"]["resume"]["status"] == "differs"
    assert _details(record) == [
        "the data position restarted at epoch 0 (saved at epoch 1) on every rank: Lightning resumes an "
        "iteration-based run (max_steps) saved at the end of epoch 0 inside that epoch: it trains one batch more "
        "there and counts its epochs on from that, so the batches that follow are not the uninterrupted run's"
    ]
