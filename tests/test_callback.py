"""WeightSyncAudit with real Trainers on 2 CPU ranks (ddp_fork unless said otherwise)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_helpers import Perturb, SmallModel, bit_identical, fit, rank_end, rank_weights, records
from pytorch_lightning.callbacks import BackboneFinetuning, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.strategies import DDPStrategy

from weightsync_audit.cli.lightning_20340 import SeedModel, make_loader
from weightsync_audit.integrations.lightning.audit_callback import sharded_strategy_reason
from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit


def test_seed_model_under_backbone_finetuning_is_reported_diverged_from_the_first_step_of_epoch_3(
    tmp_path: Path,
) -> None:
    report = tmp_path / "audit.jsonl"
    fit(
        tmp_path,
        SeedModel(),
        [
            BackboneFinetuning(unfreeze_backbone_at_epoch=3),
            WeightSyncAudit(every_n_train_steps=1, report_path=str(report)),
        ],
        max_epochs=4,
        data=make_loader(0),
    )
    recs = records(report)
    cadence = [r for r in recs if r["hook"] == "on_train_batch_end"]
    assert [r["step"] for r in cadence] == list(range(1, 65)), "one audit per optimizer step"
    first_bad = next(r for r in recs if not r["in_sync"])
    assert (first_bad["step"], first_bad["epoch"], first_bad["last_in_sync_step"]) == (49, 3, 48)
    assert all(r["in_sync"] for r in recs if r["step"] < 49)
    names = sorted(m["name"] for m in first_bad["mismatches"])
    assert names == ["backbone.bias", "backbone.weight"]  # and not the head
    assert all(m["kind"] == "param" and m["ranks"] == [1] and m["max_abs_diff"] > 0 for m in first_bad["mismatches"])
    assert "DistributedDataParallel does not all-reduce" in first_bad["hints"][0]
    assert first_bad["action"] == "warned"
    # it stays diverged and training went on
    assert all(not r["in_sync"] for r in recs if r["step"] >= 49)
    assert rank_end(tmp_path, 0)["ended"] == rank_end(tmp_path, 1)["ended"] == "ok"


def _nudge_head(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    module.net[-1].weight[0, 0] += 1e-3


def _fit_planted(tmp_path: Path, plants: list[Perturb], max_epochs: int, **options: Any) -> list[dict[str, Any]]:
    """``SmallModel`` fit with ``plants`` ahead of an every-step ``WeightSyncAudit(**options)`` reporting to
    ``tmp_path / "audit.jsonl"``; the report's records."""
    report = tmp_path / "audit.jsonl"
    audit = WeightSyncAudit(every_n_train_steps=1, report_path=str(report), **options)
    fit(tmp_path, SmallModel(), [*plants, audit], max_epochs=max_epochs)
    return records(report)


def test_raise_ends_every_rank_with_weight_divergence_error_through_the_ddp_subprocess_launcher(
    tmp_path: Path, warm_python: str
) -> None:
    script = Path(__file__).parent / "scripts" / "raise_on_divergence.py"
    t0 = time.monotonic()
    proc = subprocess.run([warm_python, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "WeightDivergenceError" in proc.stderr
    ends = [rank_end(tmp_path, r) for r in (0, 1)]
    assert [e["ended"] for e in ends] == ["WeightDivergenceError", "WeightDivergenceError"], ends
    assert ends[0]["step"] == ends[1]["step"] == 3
    assert "net.2.weight" in ends[1]["message"]
    assert "Connection closed by peer" not in proc.stderr, "no rank may be left waiting on a lost peer"
    assert elapsed < 120
    last = records(tmp_path / "audit.jsonl")[-1]
    assert (last["step"], last["action"], last["in_sync"]) == (3, "raised", False)


def test_raise_under_ddp_fork_stops_the_run_with_weight_divergence_error(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="WeightDivergenceError") as info:
        _fit_planted(tmp_path, [Perturb(1, 3, _nudge_head)], 3, on_mismatch="raise")
    assert "net.2.weight" in str(info.value)
    last = records(tmp_path / "audit.jsonl")[-1]
    assert (last["step"], last["action"]) == (3, "raised")


def _nudge_head_and_momentum(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    w = module.net[-1].weight
    w[0, 0] += 1e-2
    trainer.optimizers[0].state[w]["momentum_buffer"][0, 0] += 1.0


def test_resync_recovers_from_a_divergence_planted_on_one_rank_optimizer_state_included(tmp_path: Path) -> None:
    recs = _fit_planted(tmp_path, [Perturb(1, 5, _nudge_head_and_momentum)], 2, on_mismatch="resync")
    bad = [r for r in recs if not r["in_sync"]]
    assert len(bad) == 1 and bad[0]["step"] == 5 and bad[0]["action"] == "resynced"
    assert sorted((m["name"], m["kind"]) for m in bad[0]["mismatches"]) == [
        ("net.2.weight", "param"),
        ("net.2.weight.momentum_buffer", "optimizer"),
    ]
    assert all(r["in_sync"] for r in recs if r["step"] > 5)
    assert bit_identical(rank_weights(tmp_path, 0), rank_weights(tmp_path, 1))
    o0, o1 = (torch.load(tmp_path / f"rank{r}.opt.pt", weights_only=True) for r in (0, 1))
    for k in o0["state"]:
        assert torch.equal(o0["state"][k]["momentum_buffer"], o1["state"][k]["momentum_buffer"])


def test_batchnorm_under_default_ddp_gives_no_false_alarm(tmp_path: Path) -> None:
    report = tmp_path / "audit.jsonl"
    fit(
        tmp_path,
        SmallModel(batchnorm=True),
        [WeightSyncAudit(every_n_train_steps=1, report_path=str(report))],
        max_epochs=2,
    )
    recs = records(report)
    assert recs and all(r["in_sync"] for r in recs)
    assert any("broadcast_buffers=True" in n for n in recs[-1].get("notes", []))


def test_batchnorm_with_broadcast_buffers_false_is_reported_as_buffer_divergence(tmp_path: Path) -> None:
    report = tmp_path / "audit.jsonl"
    fit(
        tmp_path,
        SmallModel(batchnorm=True),
        [WeightSyncAudit(every_n_train_steps=1, report_path=str(report))],
        strategy=DDPStrategy(start_method="fork", broadcast_buffers=False),
        max_epochs=1,
    )
    bad = [r for r in records(report) if not r["in_sync"]]
    assert bad
    kinds = {(m["name"], m["kind"]) for m in bad[0]["mismatches"]}
    assert {("net.1.running_mean", "buffer"), ("net.1.running_var", "buffer")} <= kinds
    assert all(k == "buffer" for _, k in kinds)
    assert any("broadcast_buffers=False" in h for h in bad[0]["hints"])


@pytest.mark.parametrize(
    "strategy",
    [
        DDPStrategy(start_method="fork", find_unused_parameters=True),
        DDPStrategy(start_method="fork", static_graph=True),
    ],
    ids=["find_unused_parameters", "static_graph"],
)
def test_ddp_settings_and_gradient_accumulation_raise_no_false_alarm(tmp_path: Path, strategy: DDPStrategy) -> None:
    # DDP's static_graph cannot take no_sync() (its reducer asserts), so accumulation only without it.
    accumulate = 1 if strategy._ddp_kwargs.get("static_graph") else 2
    report = tmp_path / "audit.jsonl"
    fit(
        tmp_path,
        SmallModel(optimizer="adam"),
        [
            WeightSyncAudit(
                every_n_train_steps=1, include=("params", "buffers", "optimizer", "grads"), report_path=str(report)
            )
        ],
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        max_epochs=2,
    )
    recs = records(report)
    assert all(r["in_sync"] for r in recs)
    cadence = [r["step"] for r in recs if r["hook"] == "on_train_batch_end"]
    assert cadence == list(range(1, 16 // accumulate + 1)), "once per global_step even with accumulation"
    grads = [r for r in recs if r["hook"] == "on_before_optimizer_step"]
    assert [r["step"] for r in grads] == cadence and all(r["checked"]["grad"] == 4 for r in grads)


def test_metrics_reach_the_trainers_loggers_at_the_audited_steps(tmp_path: Path) -> None:
    fit(
        tmp_path,
        SmallModel(),
        [WeightSyncAudit(every_n_train_steps=4, hooks=())],
        logger=CSVLogger(str(tmp_path), name="logs", version=0),
        max_epochs=2,
        log_every_n_steps=1,
    )
    text = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()
    header, *rows = text.strip().splitlines()
    cols = header.split(",")
    for name in ("weightsync/in_sync", "weightsync/diverged_tensors", "weightsync/audit_ms"):
        assert name in cols
    idx = cols.index("weightsync/in_sync")
    step_idx = cols.index("step")
    logged = [(int(r.split(",")[step_idx]), r.split(",")[idx]) for r in rows if r.split(",")[idx]]
    assert [s for s, _ in logged] == [4, 8, 12, 16] and all(v == "1.0" for _, v in logged)


class _LoadedOnOneRank(SmallModel):
    """Simulates resuming from a checkpoint that one rank read differently (optimizer state)."""

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.trainer.global_rank == 1:
            for state in checkpoint["optimizer_states"][0]["state"].values():
                state["momentum_buffer"].add_(0.5)


def test_history_survives_checkpoint_and_resume_and_on_train_start_catches_a_one_rank_load(tmp_path: Path) -> None:
    report = tmp_path / "audit.jsonl"
    ckpt_dir = tmp_path / "ckpt"
    fit(
        tmp_path,
        SmallModel(),
        [
            WeightSyncAudit(every_n_train_steps=2, report_path=str(report)),
            ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True),
        ],
        enable_checkpointing=True,
        max_epochs=1,
    )
    first = records(report)
    ckpt = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    [state] = [v for k, v in ckpt["callbacks"].items() if "WeightSyncAudit" in k]
    # Every audit before the save is in the saved history; the audit of the save itself (the last record) runs
    # once the file is written, to write its sidecar.
    assert state["history"]["audits"] == len(first) - 1 and state["history"]["last_in_sync_step"] == 8
    assert first[-1]["checkpoint"].pop("resume")["status"] == "recorded"  # every rank's resume state, kept
    assert first[-1]["checkpoint"] == {
        "path": str(ckpt_dir / "last.ckpt"),
        "event": "saved",
        "status": "verified",
        "saved_step": 8,
    }
    fit(
        tmp_path,
        _LoadedOnOneRank(),
        [WeightSyncAudit(every_n_train_steps=2, report_path=str(report), on_mismatch="warn")],
        max_epochs=2,
        ckpt_path=str(ckpt_dir / "last.ckpt"),
    )
    second = records(report)[len(first) :]
    start = second[0]
    assert start["hook"] == "on_train_start" and start["step"] == 8 and not start["in_sync"]
    assert start["last_in_sync_step"] == 8, "history restored from the checkpoint"
    assert {m["kind"] for m in start["mismatches"]} == {"optimizer"}
    assert all(m["ranks"] == [1] for m in start["mismatches"])


def test_state_dict_round_trip_and_old_checkpoints() -> None:
    cb = WeightSyncAudit()
    cb.history.audits, cb.history.first_divergence_step, cb.history.first_divergence_tensors = 7, 3, ["a.weight"]
    cb.history.last_in_sync_step = 2
    fresh = WeightSyncAudit()
    fresh.load_state_dict(cb.state_dict())
    assert fresh.state_dict() == cb.state_dict()
    old = WeightSyncAudit()
    old.load_state_dict({"history": {"audits": 4}})  # an older, partial state
    assert old.history.audits == 4 and old.history.first_divergence_step is None
    old.load_state_dict({})
    assert old.history.audits == 4


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"hooks": ("on_train_start", "on_banana")}, "hooks"),
        ({"include": ("params", "weights")}, "include"),
        ({"every_n_train_steps": 0}, "every_n_train_steps"),
        ({"every_n_train_steps": 2.5}, "every_n_train_steps"),
        ({"on_mismatch": "ignore"}, "on_mismatch"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"resync_src": -1}, "resync_src"),
        ({"coverage": 0.3}, "coverage"),
        ({"report_path": "/nonexistent-dir/audit.jsonl"}, "report_path"),
    ],
)
def test_invalid_arguments_fail_at_construction_naming_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        WeightSyncAudit(**kwargs)


def test_unwritable_report_path_fails_at_construction(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="report_path.*is a file, not a directory"):
        WeightSyncAudit(report_path=str(tmp_path / "a-file" / "audit.jsonl"))
    with pytest.raises(ValueError, match="report_path.*is a directory"):
        WeightSyncAudit(report_path=str(tmp_path))


def test_resync_src_beyond_the_world_fails_at_setup(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="resync_src"):
        fit(
            tmp_path,
            SmallModel(),
            [WeightSyncAudit(on_mismatch="resync", resync_src=3)],
            strategy="auto",
            devices=1,
            max_epochs=1,
        )


def test_both_lightning_namespaces_take_their_own_class(tmp_path: Path) -> None:
    import lightning.pytorch as L

    from weightsync_audit.lightning.lightning_pytorch import WeightSyncAudit as LWeightSyncAudit

    class LModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(32, 2)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.lin(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    report = tmp_path / "l.jsonl"
    cb = LWeightSyncAudit(every_n_train_steps=1, report_path=str(report), verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    from lightning_helpers import loader

    trainer.fit(LModel(), loader())
    assert [r["step"] for r in records(report) if r["hook"] == "on_train_batch_end"] == [1, 2, 3]
    assert isinstance(cb, L.Callback) and not isinstance(cb, pl.Callback)
    assert isinstance(WeightSyncAudit(), pl.Callback) and not isinstance(WeightSyncAudit(), L.Callback)


def test_fsdp1_and_ddp_strategies_are_audited_not_refused() -> None:
    # Lightning's FSDP needs a GPU to build a Trainer; the decision only reads the strategy.
    from pytorch_lightning.strategies import FSDPStrategy

    assert sharded_strategy_reason(FSDPStrategy()) is None  # FSDP1: audited through its replica adapter
    assert sharded_strategy_reason(DDPStrategy()) is None


def _nudge_first_layer(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    module.net[0].bias[0] += 1e-3


def test_warn_prints_the_report_when_a_divergence_appears_or_changes_not_every_step(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    recs = _fit_planted(tmp_path, [Perturb(1, 3, _nudge_head), Perturb(1, 6, _nudge_first_layer)], 1, hooks=())
    err = capfd.readouterr().err
    assert sum(not r["in_sync"] for r in recs) == 6  # steps 3..8 all diverged, each recorded
    assert all(r["action"] == "warned" for r in recs if not r["in_sync"])
    assert err.count("DIVERGED") == 2, err  # printed at step 3 and when the set grew at step 6
    assert "step 3 (epoch 0): DIVERGED" in err and "step 6 (epoch 0): DIVERGED" in err
    assert "8 audit(s), 6 found divergence; first at step 3" in " ".join(err.split())  # fit-end summary


def test_lightning_cli_builds_the_callback_from_yaml(tmp_path: Path) -> None:
    from pytorch_lightning.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  logger: false
  callbacks:
    - class_path: weightsync_audit.lightning.pytorch_lightning.WeightSyncAudit
      init_args:
        every_n_train_steps: 5
        hooks: [on_train_start, on_fit_end]
        include: [params, optimizer]
        exclude: ["layer.*"]
        on_mismatch: raise
        timeout_s: 30
        coverage: 1/4
"""
    )
    cli = LightningCLI(SeedModel, run=False, args=["--config", str(config)])
    [cb] = [c for c in cli.trainer.callbacks if isinstance(c, WeightSyncAudit)]
    assert (cb.every_n_train_steps, cb.hooks, cb.include, cb.exclude) == (
        5,
        ("on_train_start", "on_fit_end"),
        ("params", "optimizer"),
        ("layer.*",),
    )
    assert (cb.on_mismatch, cb.timeout_s, cb.slices) == ("raise", 30.0, 4)


def test_ddp_spawn_runs_in_sync_with_no_false_alarm(tmp_path: Path, warm_spawn: None) -> None:
    report = tmp_path / "audit.jsonl"
    fit(
        tmp_path,
        SmallModel(batchnorm=True, optimizer="adam"),
        [WeightSyncAudit(every_n_train_steps=2, report_path=str(report))],
        strategy="ddp_spawn",
        max_epochs=1,
    )
    recs = records(report)
    assert [r["step"] for r in recs if r["hook"] == "on_train_batch_end"] == [2, 4, 6, 8]
    assert all(r["in_sync"] for r in recs)
    # BatchNorm's running stats differ after the last forward (DDP re-broadcasts them at the next one)
    w0, w1 = ({k: v for k, v in rank_weights(tmp_path, r).items() if "running_" not in k} for r in (0, 1))
    assert bit_identical(w0, w1)


class _Stall(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 3:
            time.sleep(8)


def test_a_rank_that_stalls_past_timeout_s_makes_the_others_raise_naming_it_under_raise(tmp_path: Path) -> None:
    t0 = time.monotonic()
    audit = WeightSyncAudit(every_n_train_steps=1, timeout_s=2, on_mismatch="raise")
    with pytest.raises(Exception, match="AuditTimeoutError") as info:
        fit(tmp_path, SmallModel(), [_Stall(), audit], max_epochs=1)
    elapsed = time.monotonic() - t0
    assert "rank(s) [1] did not arrive" in str(info.value)
    assert "Process 0" in str(info.value), "rank 0 gave up first, at the deadline, not when rank 1 woke"
    assert elapsed < 8


def test_a_rank_that_stalls_past_timeout_s_under_warn_is_reported_and_training_finishes(tmp_path: Path) -> None:
    fit(tmp_path, SmallModel(), [_Stall(), WeightSyncAudit(every_n_train_steps=1, timeout_s=2)], max_epochs=1)
    assert rank_end(tmp_path, 0) == rank_end(tmp_path, 1) == {"ended": "ok", "step": 8}
