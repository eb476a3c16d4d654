"""The Hugging Face Trainer set-up the tests and tests/scripts share: quiet CPU ``TrainingArguments``, a tiny
regression model, its rows and the Trainer over them.

``transformers`` is imported inside the functions, so a test module can import this one before its
``pytest.importorskip("transformers")``. The scripts under tests/scripts put this folder on ``sys.path``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrun import OFFLINE

QUIET: dict[str, Any] = {"use_cpu": True, "save_strategy": "no", "report_to": [], "disable_tqdm": True}
"""Every test Trainer's arguments: CPU, no checkpoints, no trackers, no progress bar."""

GLOO: dict[str, Any] = {"ddp_backend": "gloo", "ddp_timeout": 120}
"""Added for a Trainer run by ``torchrun``: CPU ranks over gloo, a hang ends in two minutes."""


def go_offline() -> None:
    """Set ``torchrun.OFFLINE`` in this process's environment where it is not set already: call it before
    ``transformers`` is imported."""
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)


def training_args(output_dir: str | Path, *, gloo: bool = False, **overrides: Any) -> Any:
    """``TrainingArguments`` with :data:`QUIET` (and :data:`GLOO` with ``gloo``), ``overrides`` on top."""
    from transformers import TrainingArguments

    kwargs = {**QUIET, **(GLOO if gloo else {}), **overrides}
    return TrainingArguments(output_dir=str(output_dir), **kwargs)


class TinyNet(nn.Module):
    """Four features to one value; ``forward`` returns the MSE loss, as the Trainer wants.

    With ``seed``, ``torch.manual_seed(seed)`` first: every rank starts from the same weights.
    """

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.layer = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.layer(x).squeeze(-1), labels)}


def tiny_rows(n: int, seed: int | None = None) -> list[dict[str, torch.Tensor]]:
    """``n`` rows for :class:`TinyNet`, drawn from the global stream or, with ``seed``, a generator of their own."""
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(4, generator=g), "labels": torch.randn((), generator=g)} for _ in range(n)]


def tiny_trainer(
    output_dir: str | Path, callbacks: list[Any], *, rows: int, model_seed: int | None = None, **overrides: Any
) -> Any:
    """A ``Trainer`` over :class:`TinyNet` (``model_seed`` for its weights) and ``rows`` random rows; ``overrides`` go
    to :func:`training_args`. The rows are drawn before the model is built, as the tests always did."""
    from transformers import Trainer

    args = training_args(output_dir, **overrides)
    data = tiny_rows(rows)
    return Trainer(model=TinyNet(model_seed), args=args, train_dataset=data, callbacks=callbacks)
