"""Run under ``torchrun`` on 2 ranks: the Hugging Face Trainer with ``deepspeed=`` ZeRO-2 and ZeRO-3 on CPU.

Each rank writes ``OUT/<scenario>.rank<r>.json``; tests/test_replicas_trainers.py judges.
Usage: torchrun --nnodes=2 --nproc_per_node=1 --node-rank=N ... hf_deepspeed_run.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import deepspeed  # noqa: F401 - imported before the Trainer: its accelerator is settled once
import torch.distributed as dist
from trainers_run import At, gpt2, records, tokens, train  # the Trainer helpers of tests/scripts

from weightsync_audit.transformers import WeightSyncAuditCallback

OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])


def zero(stage: int, plant: bool) -> dict[str, Any]:
    path = OUT / f"zero{stage}_{plant}.jsonl"
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 100  # 2-D weights partitioned
    cb = WeightSyncAuditCallback(every_n_steps=2, report_path=str(path), timeout_s=60)
    callbacks: list[Any] = [cb]
    if plant:  # before the audit of step 4 (ZeRO-2 would overwrite it at the next step): a replicated parameter
        callbacks.insert(0, At("on_step_end", 4, lambda m, o: m.transformer.h[1].ln_1.weight.data.add_(1e-3)))
    train(gpt2(), tokens(), callbacks, deepspeed=config, max_steps=4)
    return {"records": records(path)}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    for stage in (2, 3):
        for plant in (False, True):
            name = f"zero{stage}_{plant}"
            try:
                out = zero(stage, plant)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            (OUT / f"{name}.rank{RANK}.json").write_text(json.dumps(out, default=str))
    dist.barrier()
    dist.destroy_process_group()
