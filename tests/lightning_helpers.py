"""Small real Lightning runs for the callback tests, with per-rank results written to files.

Workers of ``ddp_fork`` are forked inside ``trainer.fit``, so what each rank saw comes back only
through files: :class:`RankProbe` saves each rank's final weights and the exception it ended with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from weightsync_audit.cli.lightning_20340 import RandomDataset
from weightsync_audit.reporting.jsonl import read_report


class RankProbe(pl.Callback):
    """Writes ``rank{r}.pt`` (final state_dict) and ``rank{r}.json`` (how the rank ended)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        r = trainer.global_rank
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.out / f"rank{r}.pt")
        opt = trainer.optimizers[0].state_dict() if trainer.optimizers else {}
        torch.save(opt, self.out / f"rank{r}.opt.pt")
        (self.out / f"rank{r}.json").write_text(json.dumps({"ended": "ok", "step": trainer.global_step}))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        info = {"ended": type(exception).__name__, "message": str(exception)[:2000], "step": trainer.global_step}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(info))


class Perturb(pl.Callback):
    """On ``rank`` at ``step`` (a ``global_step`` seen at ``on_train_batch_end``), apply ``fn``."""

    def __init__(self, rank: int, step: int, fn: Callable[[pl.Trainer, pl.LightningModule], None]) -> None:
        self.rank, self.step, self.fn = rank, step, fn

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with torch.no_grad():
                self.fn(trainer, pl_module)


class SmallModel(pl.LightningModule):
    def __init__(self, batchnorm: bool = False, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(32, 16)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(16))
        layers += [nn.ReLU(), nn.Linear(16, 2)]
        self.net = nn.Sequential(*layers)
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        y = self(batch)
        return torch.nn.functional.mse_loss(y, torch.ones_like(y))

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader(length: int = 64, batch_size: int = 4) -> DataLoader:
    pl.seed_everything(0, verbose=False)
    return DataLoader(RandomDataset(32, length), batch_size=batch_size)


def fit(
    out: Path,
    model: pl.LightningModule,
    callbacks: list[pl.Callback],
    *,
    strategy: Any = "ddp_fork",
    devices: int = 2,
    max_epochs: int = 2,
    data: DataLoader | None = None,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "strategy": strategy,
        "devices": devices,
        "max_epochs": max_epochs,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": False,
        "default_root_dir": str(out),
    }
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(callbacks=[*callbacks, RankProbe(out)], **kwargs)
    trainer.fit(model, data if data is not None else loader(), ckpt_path=ckpt_path)
    return trainer


def records(path: Path) -> list[dict[str, Any]]:
    contents = read_report(path)
    assert not contents.errors, contents.errors
    return [r.to_dict() for _, r in contents.records]


def rank_end(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"rank{rank}.json").read_text())


def rank_weights(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


def bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )
