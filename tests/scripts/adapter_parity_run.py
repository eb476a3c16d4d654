"""One planted fault under each adapter (``LoopAudit``, the Lightning callback, the Hugging Face callback), for
tests/test_adapter_parity.py: scenarios of tests/scripts/trainers_run.py (the session's one ``torchrun``
launch on 2 ranks), which imports this module.

Each scenario trains the same one-layer model (``layer``) for 4 optimizer steps with ``include`` grads,
``attribution`` and an audit every step; on rank 1 the gradient of ``layer.weight`` is changed after the
all-reduce, right before optimizer step 3. :func:`run` returns the records (rank 0's; rank 1 returns none).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared Trainer set-up
from hf_setup import TinyNet, go_offline, tiny_rows, training_args

go_offline()
warnings.filterwarnings("ignore")

OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
OPTIONS: dict[str, Any] = {"include": ("params", "buffers", "optimizer", "grads"), "attribution": True}
OPTIONS |= {"verbose": False}


def plant(model: torch.nn.Module) -> None:
    """Rank 1's gradient changed after the all-reduce (a local clip or hook gone wrong)."""
    if RANK == 1:
        with torch.no_grad():
            model.layer.weight.grad[0, 0] += 1.0


def records(path: Path) -> list[dict[str, Any]]:
    dist.barrier()
    return [json.loads(line) for line in path.read_text().splitlines()] if RANK == 0 else []


def loop(path: Path) -> None:
    from weightsync_audit import LoopAudit

    model = TinyNet(seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    rows = tiny_rows(8, seed=RANK)
    with LoopAudit(ddp, opt, every_n_steps=1, report_path=str(path), **OPTIONS) as audit:
        for step in range(1, 5):
            opt.zero_grad()
            row = rows[step]
            ddp(row["x"][None], row["labels"][None])["loss"].backward()
            if step == 3:
                plant(model)
            opt.step()
            audit.step(step, 0)


def lightning(path: Path) -> None:
    import pytorch_lightning as pl

    from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = TinyNet(seed=0).layer

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.layer(batch["x"]).squeeze(-1), batch["labels"])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Plant(pl.Callback):
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            if trainer.global_step == 2:
                plant(module)

    audit = WeightSyncAudit(every_n_train_steps=1, hooks=(), report_path=str(path), **OPTIONS)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", max_steps=4, callbacks=[Plant(), audit],
        enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
        default_root_dir=str(OUT / "parity_pl"),
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(tiny_rows(16, seed=1), batch_size=2)
    trainer.fit(Module(), loader)


def hf(path: Path) -> None:
    from transformers import Trainer, TrainerCallback

    from weightsync_audit.transformers import WeightSyncAuditCallback

    class Plant(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step == 2:
                plant(model)

    audit = WeightSyncAuditCallback(every_n_steps=1, report_path=str(path), **OPTIONS)
    args = training_args(OUT / "parity_hf", gloo=True, max_steps=4, per_device_train_batch_size=2, learning_rate=0.01)
    args.max_grad_norm = 0.0  # no clipping: the planted value reaches the step as it is
    model = TinyNet(seed=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)  # as the other adapters train
    data, callbacks = tiny_rows(16, seed=1), [Plant(), audit]
    Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks, optimizers=(sgd, None)).train()


def run(name: str) -> dict[str, Any]:
    """The ``loop``, ``lightning`` or ``hf`` scenario in the process group already open; ``{"records": [...]}``."""
    path = OUT / f"parity_{name}.jsonl"
    {"loop": loop, "lightning": lightning, "hf": hf}[name](path)
    return {"records": records(path)}
