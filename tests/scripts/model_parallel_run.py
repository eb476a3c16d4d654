"""Run by tests through Lightning's ModelParallelStrategy (its subprocess launcher) on 2 CPU ranks.

Usage: python model_parallel_run.py OUT_DIR MODE. MODE ``fsdp`` (``pytorch_lightning``): FSDP2 over
2 ranks, an lr changed on rank 1 at step 3, ``on_mismatch="warn"`` (``fsdp-attribution``: the same with
``attribution=True``). MODE ``tp`` (``lightning.pytorch``):
tensor parallel over 2 ranks, the replicated RowwiseParallel bias nudged on rank 1 at step 3,
``on_mismatch="raise"``. Each rank writes ``rank{r}.json`` saying how it ended.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from weightsync_audit.cli.lightning_20340 import RandomDataset

warnings.filterwarnings("ignore")
OUT, MODE = Path(sys.argv[1]), sys.argv[2]
if MODE == "tp":
    import lightning.pytorch as L

    from weightsync_audit.lightning.lightning_pytorch import WeightSyncAudit
else:
    import pytorch_lightning as L

    from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ln = nn.LayerNorm(32)
        self.up = nn.Linear(32, 16)
        self.down = nn.Linear(16, 2)

    def configure_model(self) -> None:
        if MODE == "tp":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            tp = self.device_mesh["tensor_parallel"]
            parallelize_module(self, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.ln(x))))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Plant(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_rank == 1 and trainer.global_step == 3:
            with torch.no_grad():
                if MODE == "tp":
                    pl_module.down.bias.to_local().add_(1e-3)
                else:
                    trainer.optimizers[0].param_groups[0]["lr"] *= 2

    def on_exception(self, trainer, pl_module, exception) -> None:  # type: ignore[no-untyped-def]
        info = {"ended": type(exception).__name__, "message": str(exception)[:2000], "step": trainer.global_step}
        (OUT / f"rank{trainer.global_rank}.json").write_text(json.dumps(info))

    def on_fit_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        (OUT / f"rank{trainer.global_rank}.json").write_text(json.dumps({"ended": "ok", "step": trainer.global_step}))


if __name__ == "__main__":
    # One thread: multi-threaded CPU kernels made the (plain) LayerNorm's gradient differ by ~1e-9
    # between the TP ranks, a real drift the audit reports (see docs/sharded.md); this run is exact.
    torch.set_num_threads(1)
    dp, tp = (1, 2) if MODE == "tp" else (2, 1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=L.strategies.ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            Plant(),
            WeightSyncAudit(
                every_n_train_steps=1,
                on_mismatch="raise" if MODE == "tp" else "warn",
                attribution=MODE == "fsdp-attribution",
                report_path=str(OUT / "audit.jsonl"),
            ),
        ],
    )
    torch.manual_seed(0)
    trainer.fit(Net(), DataLoader(RandomDataset(32, 64), batch_size=4))
