"""Lightning #20340 on 2 CPU ranks: the seed scenario, with or without ``DDPRewrapOnTrainableChange``.

Run as a script it goes through Lightning's real launchers (``ddp`` re-runs this file once per rank,
as the bug report's own script did; ``ddp_spawn`` spawns): ::

    python lightning_20340_run.py OUT_DIR [--strategy ddp] [--no-fix] [--order before|after]
                                          [--scenario unfreeze|freeze]

Every rank writes what it saw into OUT_DIR (workers are separate processes, so files are the only way
back): ``rank{r}.pt`` (final weights, and the backbone as it was when epoch 3 started) and
``rank{r}.json`` (how the rank ended, its re-wraps, the weightsync warnings it raised). Rank 0 writes
the audit report ``audit.jsonl``. The tests also import :func:`run` to use it with ``ddp_fork``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from weightsync_audit.cli.lightning_20340 import UNFREEZE_EPOCH, SeedModel, make_loader
from weightsync_audit.errors import WeightSyncWarning
from weightsync_audit.lightning.pytorch_lightning import DDPRewrapOnTrainableChange, WeightSyncAudit

FREEZE_EPOCH = 2


class Probe(pl.Callback):
    """Writes each rank's outcome; records the weightsync warnings raised during fit."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self._catcher: Any = None
        self._caught: list[warnings.WarningMessage] = []
        self._backbone_at_unfreeze: dict[str, torch.Tensor] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always", WeightSyncWarning)
        from rich.console import Console

        for cb in trainer.callbacks:  # what the audit prints on this rank, kept whole (no wrapping)
            if isinstance(cb, WeightSyncAudit):
                printed = open(self.out / f"printed{trainer.global_rank}.txt", "w")
                cb.console = Console(file=printed, width=10_000, soft_wrap=True)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == UNFREEZE_EPOCH:
            self._backbone_at_unfreeze = {k: v.detach().clone() for k, v in pl_module.backbone.state_dict().items()}

    def _write(self, trainer: pl.Trainer, ended: str, message: str = "") -> None:
        r = trainer.global_rank
        fix = next((c for c in trainer.callbacks if isinstance(c, DDPRewrapOnTrainableChange)), None)
        info = {
            "ended": ended,
            "message": message[:3000],
            "step": trainer.global_step,
            "rewraps": [
                vars(e) | {"joined": list(e.joined), "left": list(e.left)} for e in (fix.rewraps if fix else [])
            ],
            "warnings": [str(w.message) for w in self._caught if issubclass(w.category, WeightSyncWarning)],
            "warned_from": [w.filename for w in self._caught if issubclass(w.category, WeightSyncWarning)],
        }
        (self.out / f"rank{r}.json").write_text(json.dumps(info))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        torch.save(
            {"final": state, "backbone_at_unfreeze": self._backbone_at_unfreeze},
            self.out / f"rank{trainer.global_rank}.pt",
        )
        self._write(trainer, "ok")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._write(trainer, type(exception).__name__, str(exception))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._catcher is not None:
            self._catcher.__exit__(None, None, None)
            self._catcher = None


class FreezeHead(pl.Callback):
    """Freezes the head at the start of epoch ``FREEZE_EPOCH``: DDP's reducer then waits for it."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == FREEZE_EPOCH:
            pl_module.layer.requires_grad_(False)


class AllParamsSeedModel(SeedModel):
    """The seed model with an optimizer over every parameter (the freeze scenario trains the head first)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def callbacks(out: Path, *, fix: bool, order: str, scenario: str, on_mismatch: str) -> list[pl.Callback]:
    audit = WeightSyncAudit(
        every_n_train_steps=1,
        on_mismatch=on_mismatch,
        report_path=str(out / "audit.jsonl"),
        verbose=on_mismatch != "raise",
    )
    change: pl.Callback = (
        pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE_EPOCH)
        if scenario == "unfreeze"
        else FreezeHead()
    )
    cbs: list[pl.Callback] = [audit, change]
    if fix:
        # "before": ahead of the callback that changes the trainable set (its batch-start check
        # catches it); "after": behind it (its epoch-start check does).
        cbs.insert(0 if order == "before" else len(cbs), DDPRewrapOnTrainableChange())
    return [Probe(out), *cbs]


def run(
    out: str | Path,
    *,
    strategy: str = "ddp_fork",
    fix: bool = True,
    order: str = "before",
    scenario: str = "unfreeze",
    on_mismatch: str = "raise",
    max_epochs: int = 5,
) -> None:
    out = Path(out)
    loader = make_loader(0)  # seeds, then the report's data; the model is built after, as in the report
    model = SeedModel() if scenario == "unfreeze" else AllParamsSeedModel()
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=2,
        max_epochs=max_epochs,
        callbacks=callbacks(out, fix=fix, order=order, scenario=scenario, on_mismatch=on_mismatch),
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--no-fix", dest="fix", action="store_false")
    p.add_argument("--order", choices=("before", "after"), default="before")
    p.add_argument("--scenario", choices=("unfreeze", "freeze"), default="unfreeze")
    p.add_argument("--on-mismatch", default="raise")
    a = p.parse_args(argv)
    run(a.out, strategy=a.strategy, fix=a.fix, order=a.order, scenario=a.scenario, on_mismatch=a.on_mismatch)


if __name__ == "__main__":
    main(sys.argv[1:])
