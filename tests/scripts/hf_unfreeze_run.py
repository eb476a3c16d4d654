"""Run under ``torchrun`` on 2 ranks: a layer unfrozen mid-run under the Hugging Face Trainer's DDP wrap.

``bug``: the body is frozen when ``trainer.train()`` wraps the model, the optimizer covers every
parameter, a callback unfreezes the body at step 2: DDP never all-reduces it. ``fix``: the fix the audit
offers (TRAINER_FIX): every parameter trainable at the wrap, the body frozen in ``on_train_begin``,
``ddp_find_unused_parameters=True``, the same unfreeze at step 2. Each rank writes ``OUT/<name>.rank<r>.json``;
tests/test_hf_unfreeze.py judges. Usage: torchrun ... hf_unfreeze_run.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared Trainer set-up
from hf_setup import go_offline, training_args

go_offline()

from transformers import Trainer, TrainerCallback  # noqa: E402 - after go_offline()

from weightsync_audit.transformers import WeightSyncAuditCallback  # noqa: E402

OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.head(torch.relu(self.body(x))).squeeze(-1), labels)}


def features() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 8, generator=g)
    return [{"x": row, "labels": row.sum()} for row in x]


class Unfreeze(TrainerCallback):
    """Freezes the body at ``on_train_begin`` (with ``freeze_at_begin``) and unfreezes it at step 2, on every rank."""

    def __init__(self, freeze_at_begin: bool) -> None:
        self.freeze_at_begin = freeze_at_begin
        self.body_at: dict[int, list[float]] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if self.freeze_at_begin:
            model.body.requires_grad_(False)

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.body_at[state.global_step] = model.body.weight.detach().flatten()[:4].tolist()
        if state.global_step == 2:
            model.body.requires_grad_(True)


def run(name: str) -> dict[str, Any]:
    model = Net()
    fix = name == "fix"
    if not fix:
        model.body.requires_grad_(False)  # frozen when trainer.train() wraps the model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # over every parameter
    path = OUT / f"{name}.jsonl"
    unfreeze = Unfreeze(freeze_at_begin=fix)
    args = training_args(
        OUT / name, gloo=True, max_steps=6, per_device_train_batch_size=4, logging_steps=1, seed=0,
        ddp_find_unused_parameters=fix,
    )  # fmt: skip
    cb = WeightSyncAuditCallback(every_n_steps=1, report_path=str(path), verbose=False)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=features(),
        callbacks=[unfreeze, cb],
        optimizers=(optimizer, None),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    dist.barrier()
    recs = [json.loads(line) for line in path.read_text().splitlines()] if RANK == 0 else []
    return {
        "warnings": [str(w.message) for w in caught if "weightsync audit" in str(w.message)],
        "records": recs,
        "body_at": unfreeze.body_at,
        "wrapper": type(trainer.model_wrapped).__name__,
    }


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    for name in ("bug", "fix"):
        try:
            out = run(name)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        (OUT / f"{name}.rank{RANK}.json").write_text(json.dumps(out, default=str))
    dist.barrier()
    dist.destroy_process_group()
