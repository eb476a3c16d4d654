"""Lightning #20340: under DDP, ``BackboneFinetuning`` unfreezes the backbone and replicas drift.

The model, data and callback settings are the bug report's own (``shared/seed/``): a 32->16 backbone,
a 16->2 head, 64 random samples, batch size 2, SGD over the trainable parameters at lr 0.1, and
``BackboneFinetuning(unfreeze_backbone_at_epoch=3)``. On 2 ranks each epoch is 16 optimizer steps,
so epoch 3 starts at step 49 (``global_step`` after the step).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["UNFREEZE_EPOCH", "RandomDataset", "SeedModel", "make_loader", "seed_model_for"]

UNFREEZE_EPOCH = 3


class RandomDataset(Dataset):
    def __init__(self, size: int, length: int) -> None:
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


class _SeedModelMixin:
    """The bug report's ``SimpleModel``, without its own (rank-0-only, hanging) weight check.

    A mixin so that each Lightning namespace gets the same model over its own ``LightningModule``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(32, 16)
        self.layer = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.relu(self.backbone(x)))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        y_hat = self(batch)
        return torch.nn.functional.mse_loss(y_hat, torch.ones_like(y_hat))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)


class SeedModel(_SeedModelMixin, pl.LightningModule):
    """The bug report's model for ``import pytorch_lightning``."""


def seed_model_for(lightning_module: type) -> type:
    """The same model over another namespace's ``LightningModule`` (e.g. ``lightning.pytorch``)."""
    return type("SeedModel", (_SeedModelMixin, lightning_module), {"__doc__": SeedModel.__doc__})


def make_loader(seed: int = 0, batch_size: int = 2, length: int = 64, sampler: Any = None) -> DataLoader:
    """The report's loader: ``seed_everything(seed)`` then 64 random 32-vectors, batches of 2."""
    pl.seed_everything(seed, verbose=False)
    return DataLoader(RandomDataset(32, length), batch_size=batch_size, sampler=sampler)
