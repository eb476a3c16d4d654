"""Under ``on_mismatch="warn"`` with ``pinpoint=True``, a tensor the audit cannot read (a sparse COO buffer,
common in GNNs) is a warning, never the end of training: in the Lightning callback and in the Hugging Face
callback's ``on_step_end`` (both record each step through the same runner). Real trainers, one process.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_setup import training_args
from lightning_helpers import SmallModel, fit
from torch import nn
from torchrun import OFFLINE

from weightsync_audit import WeightSyncWarning
from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit


class SparseBufferModel(SmallModel):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("adjacency", torch.eye(4).to_sparse())  # a GNN's graph: sparse COO


def test_lightning_callback_with_pinpoint_warns_on_an_unreadable_buffer_and_trains_to_the_end(tmp_path: Path) -> None:
    audit = WeightSyncAudit(every_n_train_steps=4, on_mismatch="warn", pinpoint=True, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, SparseBufferModel(), [audit], strategy="auto", devices=1, max_epochs=1)
    assert trainer.global_step == 16  # every step of the epoch ran
    texts = [str(w.message) for w in caught if issubclass(w.category, WeightSyncWarning)]
    assert any("pinpoint could not digest step 1" in t and "adjacency" in t for t in texts), texts
    assert sum("pinpoint could not digest" in t for t in texts) == 1  # once, not every step


class SparseNet(nn.Module):
    """A model the HF Trainer can train (``forward`` returns the loss), holding a sparse buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 1)
        self.register_buffer("adjacency", torch.eye(4).to_sparse())

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.body(x).squeeze(-1), labels)}


def test_hf_callback_on_step_end_with_pinpoint_warns_on_an_unreadable_buffer_and_trains_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    from transformers import Trainer

    from weightsync_audit.transformers import WeightSyncAuditCallback

    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 8, generator=g)
    data: list[dict[str, Any]] = [{"x": row, "labels": row.sum()} for row in x]
    callback = WeightSyncAuditCallback(every_n_steps=2, on_mismatch="warn", pinpoint=True, verbose=False)
    args = training_args(tmp_path / "out", max_steps=6, per_device_train_batch_size=4, logging_steps=100)
    trainer = Trainer(model=SparseNet(), args=args, train_dataset=data, callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert trainer.state.global_step == 6
    texts = [str(w.message) for w in caught if issubclass(w.category, WeightSyncWarning)]
    assert any("pinpoint could not digest step 1" in t and "adjacency" in t for t in texts), texts
    assert os.environ.get("RANK") is None
