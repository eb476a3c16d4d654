"""A scenario of trainers_run.py: the Hugging Face Trainer saves ``checkpoint-2`` on 2 ranks (each rank its
own RNG stream), then resumes from copies of it: intact; rank 1's ``rng_state_1.pth`` replaced by rank 0's;
``ignore_data_skip=True`` (the epoch's data starts over); ``scheduler.pt`` gone (the scheduler restarts).
Returns, on rank 0, each resume's ``checkpoint`` record entry; the test judges them."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from hf_setup import TinyNet, tiny_rows, training_args

from weightsync_audit.transformers import WeightSyncAuditCallback

FAULTS = ("clean", "rng_from_rank0", "ignore_data_skip", "no_scheduler")


def run(out: Path) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback

    rank = dist.get_rank()
    folder = out / "hf_resume"
    folder.mkdir(parents=True, exist_ok=True)

    class PerRankSeed(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.manual_seed(100 + rank), np.random.seed(100 + rank), random.seed(100 + rank)

    def trainer(output_dir: Path, report: Path, first: list[Any], **over: Any) -> Any:
        args = training_args(
            output_dir, gloo=True, per_device_train_batch_size=2, learning_rate=1e-2, lr_scheduler_type="constant",
            save_strategy="steps", save_steps=2, seed=0, **over,
        )  # fmt: skip
        cb = WeightSyncAuditCallback(every_n_steps=None, report_path=str(report), verbose=False)
        return Trainer(model=TinyNet(seed=0), args=args, train_dataset=tiny_rows(16, seed=1), callbacks=[*first, cb])

    trainer(folder, folder / "train.jsonl", [PerRankSeed()], max_steps=2).train()
    saved = folder / "checkpoint-2"
    out_: dict[str, Any] = {}
    for fault in FAULTS:
        copy = folder / fault / "checkpoint-2"
        if rank == 0:
            shutil.copytree(saved, copy)
            if fault == "rng_from_rank0":
                shutil.copy(copy / "rng_state_0.pth", copy / "rng_state_1.pth")
            if fault == "no_scheduler":
                (copy / "scheduler.pt").unlink()
        dist.barrier()
        report = folder / f"{fault}.jsonl"
        t = trainer(copy.parent, report, [], max_steps=3, ignore_data_skip=fault == "ignore_data_skip")
        t.train(resume_from_checkpoint=str(copy))
        dist.barrier()
        if rank == 0:
            first = json.loads(report.read_text().splitlines()[0])
            out_[fault] = {"hook": first["hook"], "checkpoint": first["checkpoint"], "notes": first.get("notes", [])}
            out_[fault]["folder"] = str(copy)
    if rank == 0:
        out_["sidecar_resume"] = json.loads((saved / "weightsync.json").read_text()).get("resume")
    return out_
