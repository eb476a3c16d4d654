"""Run under ``torchrun`` on 2 ranks: the Hugging Face Trainer with ``deepspeed=`` ZeRO-2 and ZeRO-3 on CPU,
and launched as ``accelerate launch --use_deepspeed`` would (the plugin in Accelerate's variables only).

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

import deepspeed  # imported before the Trainer: its accelerator is settled once
import torch.distributed as dist
from trainers_run import At, BNNet, features, gpt2, records, tokens, train  # the Trainer helpers of tests/scripts

from weightsync_audit.transformers import WeightSyncAuditCallback

# Its shared-memory op serves inference only: not built (tests/test_replicas_deepspeed.py says why).
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])


def ds_config(stage: int) -> dict[str, Any]:
    """The DeepSpeed config of these runs: ZeRO ``stage``, batch sizes from the Trainer."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 100  # 2-D weights partitioned
    return config


def zero(stage: int, plant: int) -> dict[str, Any]:
    path = OUT / f"zero{stage}_{int(plant)}.jsonl"
    config = ds_config(stage)
    cb = WeightSyncAuditCallback(every_n_steps=2, report_path=str(path), timeout_s=60)
    callbacks: list[Any] = [cb]
    if plant:  # before the audit of step 4 (ZeRO-2 would overwrite it at the next step): a replicated parameter
        callbacks.insert(0, At("on_step_end", 4, lambda m, o: m.transformer.h[1].ln_1.weight.data.add_(1e-3)))
    train(gpt2(), tokens(), callbacks, deepspeed=config, max_steps=4)
    return {"records": records(path)}


def zero2_batchnorm() -> dict[str, Any]:
    """DeepSpeed broadcasts buffers at initialisation only: per-rank BatchNorm statistics are compared."""
    path = OUT / "zero2_batchnorm.jsonl"
    config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    cb = WeightSyncAuditCallback(every_n_steps=2, report_path=str(path), timeout_s=60)
    train(BNNet(), features(), [cb], deepspeed={**config, "zero_allow_untested_optimizer": True}, max_steps=2)
    return {"records": records(path)}


def fsdp_on_cpu() -> dict[str, Any]:
    """``fsdp="full_shard"`` on CPU: Accelerate trains plain DDP, so the run is audited as DDP."""
    path = OUT / "fsdp_on_cpu.jsonl"
    cb = WeightSyncAuditCallback(every_n_steps=2, report_path=str(path), timeout_s=60)
    train(gpt2(), tokens(), [cb], fsdp="full_shard", max_steps=2)
    return {"records": records(path)}


def launched(env: dict[str, str]) -> dict[str, str]:
    """The variables ``accelerate launch --use_deepspeed`` sets for its processes (accelerate/utils/launch.py,
    ``prepare_deepspeed_cmd_env``): ``args.deepspeed`` stays unset, the Trainer builds the plugin from these."""
    return {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "no", **env}


def via_accelerate(name: str, env: dict[str, str], model: Any, data: Any, plant: bool) -> dict[str, Any]:
    """A Trainer launched as ``accelerate launch --use_deepspeed`` would: no ``deepspeed=`` argument."""
    from weightsync_audit.integrations.hf.engines import engine_of

    path = OUT / f"{name}.jsonl"
    cb = WeightSyncAuditCallback(every_n_steps=2, report_path=str(path), timeout_s=60)
    callbacks: list[Any] = [cb]
    if plant:  # before the audit of step 4: a replicated parameter on rank 1
        callbacks.insert(0, At("on_step_end", 4, lambda m, o: m.transformer.h[1].ln_1.weight.data.add_(1e-3)))
    env = launched(env)
    os.environ.update(env)
    try:
        trainer = train(model, data, callbacks, max_steps=4)
    finally:
        for key in env:
            os.environ.pop(key, None)
    plugin = trainer.accelerator.state.deepspeed_plugin
    return {
        "records": records(path),
        "args_deepspeed": trainer.args.deepspeed,  # None: only Accelerate knows
        "zero_stage": plugin.zero_stage if plugin is not None else None,
        "engine_of": engine_of(trainer.args),
    }


def accelerate_config_file(stage: int) -> dict[str, Any]:
    """``accelerate launch --use_deepspeed --deepspeed_config_file ds.json``: GPT-2, rank 1 planted at step 4."""
    config = ds_config(stage)
    file = OUT / f"ds_zero{stage}.json"
    file.write_text(json.dumps(config))
    env = {"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(file), "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_config_file"}
    return via_accelerate(f"accelerate_zero{stage}", env, gpt2(), tokens(), plant=True)


def accelerate_zero2_batchnorm() -> dict[str, Any]:
    """``accelerate launch --use_deepspeed --zero_stage 2`` (no config file): the buffer policy is DeepSpeed's."""
    env = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage"}
    return via_accelerate("accelerate_zero2_batchnorm", env, BNNet(), features(), plant=False)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    # FSDP first: Accelerate's state keeps DeepSpeed's plugin for every later Trainer of the process.
    runs: dict[str, Any] = {"fsdp_on_cpu": fsdp_on_cpu}
    runs.update({f"zero{st}_{pl}": (lambda st=st, pl=pl: zero(st, pl)) for st in (2, 3) for pl in (0, 1)})
    runs.update(zero2_batchnorm=zero2_batchnorm)
    runs.update({f"accelerate_zero{st}": (lambda st=st: accelerate_config_file(st)) for st in (2, 3)})
    runs.update(accelerate_zero2_batchnorm=accelerate_zero2_batchnorm)
    for name, fn in runs.items():
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        (OUT / f"{name}.rank{RANK}.json").write_text(json.dumps(out, default=str))
    dist.barrier()
    dist.destroy_process_group()
