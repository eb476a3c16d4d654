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

    def trainer(output_dir: Path, report: Path, first: list[Any], model: Any = None, **over: Any) -> Any:
        kw = {"save_strategy": "steps", "save_steps": 2, **over}
        args = training_args(
            output_dir, gloo=True, per_device_train_batch_size=2, learning_rate=1e-2, lr_scheduler_type="constant",
            seed=0, **kw,
        )  # fmt: skip
        cb = WeightSyncAuditCallback(every_n_steps=None, report_path=str(report), verbose=False)
        model = model if model is not None else TinyNet(seed=0)
        return Trainer(model=model, args=args, train_dataset=tiny_rows(16, seed=1), callbacks=[*first, cb])

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
    out_.update(epochs(folder, rank, trainer, PerRankSeed))
    return out_


class Recording(TinyNet):
    """:class:`TinyNet` that keeps, per forward, the sum of its batch and one draw from this rank's torch RNG
    (as dropout would draw): what the run trains on, to compare runs with."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.seen: list[list[float]] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen.append([float(x.sum()), float(torch.rand(()))])
        return super().forward(x, labels)


def epochs(folder: Path, rank: int, trainer: Any, per_rank_seed: Any) -> dict[str, Any]:
    """Two epochs saved per epoch (``checkpoint-4`` holds the end of epoch 0, ``epoch`` 1.0); then resumes from
    copies of ``checkpoint-4``: with ``ignore_data_skip=True``; from a folder outside ``output_dir`` whose
    ``rng_state_1.pth`` is rank 0's. Each run's batches and draws per rank (the truth) and first record."""
    base = folder / "epochs"
    base.mkdir(parents=True, exist_ok=True)
    full = Recording()
    trainer(base, base / "full.jsonl", [per_rank_seed()], model=full, num_train_epochs=2, save_strategy="epoch").train()
    out: dict[str, Any] = {"epochs_full": full.seen}
    copies = {
        "epoch_ignore_skip": (base / "ignore" / "checkpoint-4", base / "ignore", {"ignore_data_skip": True}),
        "outside_swapped": (base / "elsewhere" / "end-of-epoch-0", base / "outside_out", {}),
    }
    for name, (copy, output_dir, over) in copies.items():
        if rank == 0:
            shutil.copytree(base / "checkpoint-4", copy)
            if name == "outside_swapped":
                shutil.copy(copy / "rng_state_0.pth", copy / "rng_state_1.pth")
        dist.barrier()
        model, report = Recording(), base / f"{name}.jsonl"
        t = trainer(output_dir, report, [], model=model, num_train_epochs=2, save_strategy="no", **over)
        t.train(resume_from_checkpoint=str(copy))
        dist.barrier()
        first = json.loads(report.read_text().splitlines()[0]) if rank == 0 else {}
        out[name] = {"seen": model.seen, "checkpoint": first.get("checkpoint"), "notes": first.get("notes", [])}
    return out
