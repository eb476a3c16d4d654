"""Run under ``torchrun`` on 2 ranks: Lightning's FSDP1 and DeepSpeed strategies on CPU, audited by the callback.

Each scenario is one ``Trainer.fit`` (4 steps, an audit every 2 and at the default hooks) under a test-only
CPU strategy (tests/sharded_strategies.py): the audits of steps 0 and 2 see a healthy run; then 1 is added on
rank 1 to replicated tensors right before the audit of step 4 (``zero2_resync``: which resyncs them);
Lightning's default checkpoint at the epoch's end is audited too, and its sidecar written. Every rank writes ``OUT/<scenario>.rank<r>.json`` (how its fit ended, and the
JSONL records rank 0 wrote); tests/test_lightning_sharded.py judges.
Usage: torchrun --nnodes=2 --nproc_per_node=1 --node-rank=N ... lightning_sharded_run.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

try:
    import deepspeed  # imported first: its accelerator (CPU here) is settled once

    # Its shared-memory op serves inference only: not built (tests/test_replicas_deepspeed.py says why).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
except ImportError:  # the FSDP scenario runs without it
    pass
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_helpers import Perturb, SmallModel, loader, records
from sharded_strategies import CPUDeepSpeedStrategy, CPUFSDPStrategy

from weightsync_audit import WeightSyncAudit

warnings.filterwarnings("ignore")

OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])


class BufferModel(SmallModel):
    """The callback tests' model (Adam) with a buffer no engine touches after initialisation."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.register_buffer("scale", torch.ones(4))


def fit(
    name: str, strategy: Any, plant: Callable[[pl.LightningModule], None], on_mismatch: str = "warn"
) -> dict[str, Any]:
    path = OUT / f"{name}.jsonl"
    audit = WeightSyncAudit(every_n_train_steps=2, report_path=str(path), timeout_s=60, on_mismatch=on_mismatch)
    callbacks: list[pl.Callback] = [Perturb(1, 4, lambda trainer, module: plant(module)), audit]  # before its hook
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=4, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, logger=False, default_root_dir=str(OUT / name),
    )  # fmt: skip  # Lightning's default ModelCheckpoint saves at the epoch's end: audited, with a sidecar
    trainer.fit(BufferModel(), loader())
    dist.barrier()  # rank 0's report and sidecar are complete
    sidecars = sorted((OUT / name).glob("checkpoints/*/weightsync.json"))  # both engines save a directory
    return {
        "records": records(path),
        "engine": type(trainer.strategy.model).__name__,
        "sidecars": [json.loads(f.read_text()) for f in sidecars],
    }


def zero(stage: int) -> dict[str, Any]:
    zero_opt: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero_opt["stage3_param_persistence_threshold"] = 20  # the two weights are partitioned, the biases persist
    return {"zero_optimization": zero_opt, "zero_allow_untested_optimizer": True, "train_micro_batch_size_per_gpu": 4}


def bump_weights(module: pl.LightningModule) -> None:
    module.net[0].weight.data[0, 0] += 1.0  # in rank 0's part of ZeRO's flat partition
    module.net[2].bias.data[0] += 1.0  # in rank 1's own part: its fp32 master no longer matches it


def bump_persistent_and_buffer(module: pl.LightningModule) -> None:
    module.net[2].bias.data[0] += 1.0  # under ZeRO-3's persistence threshold: held whole by every rank
    module.scale[0] += 1.0


def bump_buffer(module: pl.LightningModule) -> None:
    module.scale[0] += 1.0


# One fit per strategy: the audits of steps 0 and 2 see a healthy run, the change lands before step 4's.
SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    # FSDP first: it initialises the process group as Lightning does; DeepSpeed then reuses it. Sharded
    # checkpoints: FSDP1's full state dict on CPU (rank0_only, offload_to_cpu) crashes torch itself.
    "fsdp": lambda: fit(
        "fsdp", CPUFSDPStrategy(sharding_strategy="FULL_SHARD", state_dict_type="sharded"), bump_buffer
    ),
    "zero2": lambda: fit("zero2", CPUDeepSpeedStrategy(config=zero(2)), bump_weights),
    "zero2_resync": lambda: fit("zero2_resync", CPUDeepSpeedStrategy(config=zero(2)), bump_weights, "resync"),
    "zero3": lambda: fit("zero3", CPUDeepSpeedStrategy(config=zero(3)), bump_persistent_and_buffer),
}

if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    only = sys.argv[2:] or list(SCENARIOS)
    for name in only:
        try:
            out = SCENARIOS[name]()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        (OUT / f"{name}.rank{RANK}.json").write_text(json.dumps(out, default=str))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
