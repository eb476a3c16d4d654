"""Lightning #20340 end to end: BackboneFinetuning under DDP, with and without DDPRewrapOnTrainableChange.

Real Trainers on 2 CPU gloo ranks through each of Lightning's launchers (``ddp`` re-runs a script,
``ddp_spawn`` spawns, ``ddp_fork`` forks inside ``trainer.fit``); every rank's outcome comes back
through files written by ``scripts/lightning_20340_run.py``'s ``Probe``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from scripts.lightning_20340_run import Probe, run
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from weightsync_audit.cli.lightning_20340 import UNFREEZE_EPOCH, SeedModel, make_loader, seed_model_for
from weightsync_audit.lightning.pytorch_lightning import DDPRewrapOnTrainableChange, WeightSyncAudit

SCRIPT = Path(__file__).parent / "scripts" / "lightning_20340_run.py"
FIRST_STEP_OF_EPOCH_3 = 49  # 16 optimizer steps an epoch on 2 ranks; global_step after the step


def rank_info(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"rank{rank}.json").read_text())


def rank_weights(out: Path, rank: int) -> dict[str, Any]:
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "audit.jsonl").read_text().splitlines()]


def launch(python: str, out: Path, *args: str) -> None:
    """Run the scenario script through a launcher that starts its own processes (``python``: conftest's
    ``warm_python``, through which the launcher's ranks start too)."""
    proc = subprocess.run(
        [python, str(SCRIPT), str(out), *args], capture_output=True, text=True, timeout=240, cwd=SCRIPT.parent
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs between the ranks: {(a[k] - b[k]).abs().max()}"


def test_seed_through_the_real_ddp_launcher_with_the_fix_stays_in_sync_and_trains_the_backbone(
    tmp_path: Path, warm_python: str
) -> None:
    # The fix stands first, ahead of BackboneFinetuning: its epoch-start check comes too early, the
    # batch-start one catches the unfreeze. The audit raises on any divergence.
    launch(warm_python, tmp_path, "--strategy", "ddp", "--order", "before")
    infos = [rank_info(tmp_path, r) for r in (0, 1)]
    assert [i["ended"] for i in infos] == ["ok", "ok"], infos
    recs = records(tmp_path)
    assert all(r["in_sync"] for r in recs)
    assert {r["epoch"] for r in recs} == {0, 1, 2, 3, 4}
    assert [r["step"] for r in recs if r["hook"] == "on_train_batch_end"] == list(range(1, 81))
    for info in infos:
        [event] = info["rewraps"]
        assert (event["epoch"], event["step"], event["hook"]) == (UNFREEZE_EPOCH, 48, "on_train_batch_start")
        assert event["joined"] == ["backbone.weight", "backbone.bias"] and event["left"] == []
        assert info["warnings"] == []  # WeightSyncAudit saw the new wrapper: no trainable-set warning
    w0, w1 = rank_weights(tmp_path, 0), rank_weights(tmp_path, 1)
    assert_bit_identical(w0["final"], w1["final"])
    for name in ("weight", "bias"):  # the backbone trained after its unfreeze
        assert not torch.equal(w0["final"][f"backbone.{name}"], w0["backbone_at_unfreeze"][name])


class _GlobalData(Dataset):
    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class GlobalBatchSeedModel(SeedModel):
    """The seed model fed so that 2 ranks x 2 samples make exactly the single process's batch of 4.

    ``unfreeze_in_hook``: instead of BackboneFinetuning, the module unfreezes its backbone in its own
    ``on_train_batch_start``, which Lightning calls after every callback's: the fix then sees the
    change only after a backward under the stale reducer, and must average that step by hand.
    """

    def __init__(self, data: torch.Tensor, unfreeze_in_hook: bool) -> None:
        super().__init__()
        self.data = data
        self.unfreeze_in_hook = unfreeze_in_hook
        if unfreeze_in_hook:
            self.backbone.requires_grad_(False)

    def train_dataloader(self) -> DataLoader:
        ds = _GlobalData(self.data)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Explicit and unshuffled: rank r takes samples r, r+2, ...; a step's 2 x 2 are 4k..4k+3.
            return DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, shuffle=False))
        return DataLoader(ds, batch_size=4)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.unfreeze_in_hook and self.current_epoch == UNFREEZE_EPOCH and batch_idx == 0:
            self.backbone.requires_grad_(True)

    def configure_optimizers(self) -> Any:
        if self.unfreeze_in_hook:  # SGD skips parameters without a gradient while they are frozen
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return super().configure_optimizers()


def _fit_global_batch(out: Path, devices: int, unfreeze_in_hook: bool) -> None:
    data = make_loader(0).dataset.data  # seeds, then the report's data; the model is built after
    model = GlobalBatchSeedModel(data, unfreeze_in_hook)
    cbs: list[pl.Callback] = [Probe(out), WeightSyncAudit(every_n_train_steps=1, on_mismatch="raise", verbose=False)]
    if not unfreeze_in_hook:
        cbs.append(pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE_EPOCH))
    if devices > 1:
        cbs.append(DDPRewrapOnTrainableChange(verbose=False))
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp_fork" if devices > 1 else "auto",
        devices=devices,
        max_epochs=5,
        callbacks=cbs,
        use_distributed_sampler=False,  # keep the explicit, unshuffled sampler
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model)


@pytest.mark.parametrize("unfreeze_in_hook", [False, True], ids=["backbone_finetuning", "module_hook_after_callbacks"])
def test_two_rank_ddp_with_the_fix_equals_one_process_on_the_global_batch_through_the_unfreeze(
    tmp_path: Path, unfreeze_in_hook: bool
) -> None:
    ddp_out, single_out = tmp_path / "ddp", tmp_path / "single"
    ddp_out.mkdir()
    single_out.mkdir()
    _fit_global_batch(ddp_out, 2, unfreeze_in_hook)
    _fit_global_batch(single_out, 1, unfreeze_in_hook)
    w0, w1 = rank_weights(ddp_out, 0), rank_weights(ddp_out, 1)
    single = rank_weights(single_out, 0)
    assert_bit_identical(w0["final"], w1["final"])
    for k, v in single["final"].items():
        # Equal to one process on the global batch: the fix all-reduces, it does not copy rank 0.
        gap = (w0["final"][k] - v).abs().max().item()
        assert gap < 1e-6, f"{k}: 2-rank DDP is {gap} away from single-process training"
    assert not torch.equal(w0["final"]["backbone.weight"], w0["backbone_at_unfreeze"]["weight"])
    [event] = rank_info(ddp_out, 0)["rewraps"]
    assert event["joined"] == ["backbone.weight", "backbone.bias"]
    assert rank_info(ddp_out, 0)["warnings"] == []  # re-wrapped before WeightSyncAudit's check
    if unfreeze_in_hook:
        assert event["hook"] == "on_after_backward"
        assert set(event["reduced_by_hand"]) == {"backbone.weight", "backbone.bias"}
    else:
        assert event["hook"] == "on_train_epoch_start" and event["reduced_by_hand"] == []


def test_without_the_fix_the_audit_reports_the_divergence_at_the_first_step_of_epoch_3_with_the_ddp_hint(
    tmp_path: Path,
) -> None:
    run(tmp_path, strategy="ddp_fork", fix=False, on_mismatch="warn", max_epochs=4)
    recs = records(tmp_path)
    first_bad = next(r for r in recs if not r["in_sync"])
    assert (first_bad["step"], first_bad["epoch"], first_bad["last_in_sync_step"]) == (FIRST_STEP_OF_EPOCH_3, 3, 48)
    assert all(r["in_sync"] for r in recs if r["step"] < FIRST_STEP_OF_EPOCH_3)
    assert [(m["name"], m["kind"], m["ranks"]) for m in first_bad["mismatches"]] == [
        ("backbone.weight", "param", [1]),
        ("backbone.bias", "param", [1]),
    ]
    hint = first_bad["hints"][0]
    assert hint.startswith(
        "backbone.weight, backbone.bias require grad, but DistributedDataParallel does not all-reduce"
    )
    assert "DDPRewrapOnTrainableChange" in hint
    # The warning came first, once, on rank zero only: at the step that unfroze, before it moved a weight.
    [warning] = rank_info(tmp_path, 0)["warnings"]
    assert "(step 48)" in warning and "trainable parameters changed" in warning and "backbone.weight" in warning
    assert rank_info(tmp_path, 1)["warnings"] == []
    # Attributed to the user's line (trainer.fit in the script), not to Lightning's dispatch.
    [where] = rank_info(tmp_path, 0)["warned_from"]
    assert where.endswith("lightning_20340_run.py"), where
    # The ~900-character hint is said once: the printed report refers to the warning, the record keeps it whole.
    printed = (tmp_path / "printed0.txt").read_text()
    assert "DIVERGED" in printed and "the cause and its fix are in the warning at step 48 above" in printed
    assert "they became trainable after DDP wrapped the model" not in printed
    assert "Re-wrapping stops new drift" in printed  # what the report's hint adds to the warning


def test_freezing_mid_training_under_ddp_spawn_with_the_fix_trains_on_in_sync(tmp_path: Path, warm_python: str) -> None:
    # The head freezes at the start of epoch 2; the fix stands after the freezer.
    launch(warm_python, tmp_path, "--strategy", "ddp_spawn", "--scenario", "freeze", "--order", "after")
    infos = [rank_info(tmp_path, r) for r in (0, 1)]
    assert [i["ended"] for i in infos] == ["ok", "ok"] and infos[0]["step"] == 80
    [event] = infos[0]["rewraps"]
    assert (event["epoch"], event["hook"], event["left"], event["joined"]) == (
        2,
        "on_train_epoch_start",
        ["layer.weight", "layer.bias"],
        [],
    )
    assert all(r["in_sync"] for r in records(tmp_path))
    assert_bit_identical(rank_weights(tmp_path, 0)["final"], rank_weights(tmp_path, 1)["final"])


def test_freezing_mid_training_without_the_fix_breaks_ddps_reduction(tmp_path: Path) -> None:
    # DDP's "Expected to have finished reduction in the prior iteration", in Lightning's words.
    with pytest.raises(Exception, match="parameters that were not used in producing the loss"):
        run(tmp_path, strategy="ddp_fork", fix=False, scenario="freeze", on_mismatch="warn", max_epochs=3)
    # Before the crash, the one backward under the stale reducer left the backbone's bucket unreduced.
    first_bad = next(r for r in records(tmp_path) if not r["in_sync"])
    assert first_bad["step"] == 33 and "layer.weight, layer.bias were frozen after" in first_bad["hints"][0]


def test_the_lightning_pytorch_namespace_class_fixes_the_seed_too(tmp_path: Path) -> None:
    import lightning.pytorch as L

    from weightsync_audit.lightning import lightning_pytorch as lp

    LSeedModel = seed_model_for(L.LightningModule)

    loader = make_loader(0)
    report = tmp_path / "audit.jsonl"
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp_fork",
        devices=2,
        max_epochs=4,
        callbacks=[
            lp.DDPRewrapOnTrainableChange(verbose=False),
            L.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE_EPOCH),
            lp.WeightSyncAudit(every_n_train_steps=1, on_mismatch="raise", report_path=str(report), verbose=False),
        ],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(LSeedModel(), loader)
    recs = records(tmp_path)
    assert [r["step"] for r in recs if r["hook"] == "on_train_batch_end"] == list(range(1, 65))
    assert all(r["in_sync"] and r["world_size"] == 2 for r in recs)
