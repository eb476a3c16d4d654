"""The combination campaign's Trainer runs: the same model, patterns and faults in a real Lightning ``Trainer``
(strategy ``ddp``) and a real Hugging Face ``Trainer``, audited by their callbacks.

Both run inside the campaign's forked gloo ranks (the process group already up, ``RANK``/``WORLD_SIZE`` set
as a launcher sets them), so one set of ranks runs many Trainers in sequence. Each Trainer's own conventions
carry the patterns: Lightning's ``accumulate_grad_batches``, ``gradient_clip_val``, ``precision="16-mixed"``
(its GradScaler), a step-interval scheduler, LBFGS through its closure; Hugging Face's
``gradient_accumulation_steps``, ``max_grad_norm``, ``bf16`` autocast, ``optimizers=(opt, scheduler)``.
Around the audit callback, one campaign callback before it (the fault at the start of a step, the EMA, the
``E`` capture) and one after it (the ``X`` capture, then the clamp: inside an overlapped audit's window).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from campaign_case import (
    BATCH,
    EVERY,
    STEPS,
    TOKENS,
    VOCAB,
    Case,
    Faults,
    Net,
    averaged,
    build_optimizer,
    build_scheduler,
    freeze,
)
from campaign_loop import TIMEOUT_S, clamp, construct, finish
from campaign_truth import Capture
from torch import nn


def _rows(case: Case, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = STEPS * (2 if case.pattern == "accumulate" else 1) * BATCH * world
    g = torch.Generator().manual_seed(case.seed % 2**31 + 1)
    return torch.randint(0, VOCAB, (n, TOKENS), generator=g), torch.randn(n, 4, generator=g)


class _Steps:
    """Once-per-optimizer-step bookkeeping around a Trainer's hooks (Lightning calls batch hooks per micro-batch)."""

    def __init__(self, case: Case, model: nn.Module, faults: Faults, cap: Capture) -> None:
        self.case, self.model, self.faults, self.cap = case, model, faults, cap
        self.started = self.ended = self.after = 0

    def start(self, step: int) -> None:
        if step > self.started:
            self.started = step
            self.faults.at_start(step)

    def end(self, step: int) -> None:
        if step > self.ended:
            self.ended = step
            if self.case.pattern == "ema":
                self._net().update_ema()
            self.cap.snap("E", step)

    def later(self, step: int) -> None:
        if step > self.after:
            self.after = step
            self.cap.snap("X", step)
            if self.case.pattern == "clamp":
                clamp(self.model)

    def _net(self) -> Net:
        return self.model.net if hasattr(self.model, "net") else self.model  # type: ignore[return-value]


def run_lightning(case: Case, rank: int, world: int, report_path: str) -> tuple[Capture | None, dict[str, Any]]:
    """One Lightning run on this rank (ranks already joined): its capture and how it ended."""
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from weightsync_audit import WeightSyncAudit

    audit, refused = construct(
        lambda: WeightSyncAudit(
            every_n_train_steps=EVERY, verbose=False, report_path=report_path, timeout_s=TIMEOUT_S, **case.options()
        )
    )
    if refused is not None:
        return None, refused
    holder: dict[str, Any] = {}

    class LitNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(case.seed, ema=case.pattern == "ema")
            freeze(case, self.net)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids, y = batch
            loss = nn.functional.mse_loss(self.net(ids).float(), y)
            return averaged(loss) if case.optimizer == "lbfgs" else loss

        def configure_optimizers(self) -> Any:
            opt = build_optimizer(case, self.net)
            holder["handles"] = holder["faults"].attach(opt)  # before the library's hooks
            holder["cap"].attach(opt, lambda: self.trainer.global_step + 1)
            sched = build_scheduler(case, opt)
            return (
                opt if sched is None else {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
            )

    model = LitNet()
    faults = holder["faults"] = Faults(case, rank, model)
    cap = holder["cap"] = Capture(model)
    steps = _Steps(case, model, faults, cap)

    class Before(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            steps.start(trainer.global_step + 1)

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            steps.end(trainer.global_step)

    class After(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            steps.later(trainer.global_step)

    ids, y = _rows(case, world)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, max_steps=STEPS, max_epochs=-1,
        strategy=DDPStrategy(broadcast_buffers=False, process_group_backend="gloo"),
        accumulate_grad_batches=2 if case.pattern == "accumulate" else 1,
        gradient_clip_val=0.5 if case.pattern == "clip" else None,
        precision="16-mixed" if case.pattern == "scaler" else "32-true",
        callbacks=[Before(), audit, After()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tempfile.gettempdir(),
    )  # fmt: skip
    data = DataLoader(TensorDataset(ids, y), batch_size=BATCH)
    return cap, finish(lambda: trainer.fit(model, data), cap, faults, lambda: holder.get("handles", []))


class HFNet(Net):
    """:class:`Net` as the Hugging Face Trainer calls it: ``forward(ids, labels)`` returns the loss."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:  # type: ignore[override]
        out = super().forward(ids)
        return out if labels is None else {"loss": nn.functional.mse_loss(out.float(), labels)}


def run_hf(case: Case, rank: int, world: int, report_path: str) -> tuple[Capture | None, dict[str, Any]]:
    """One Hugging Face run on this rank (ranks already joined): its capture and how it ended."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from weightsync_audit.transformers import WeightSyncAuditCallback

    audit, refused = construct(
        lambda: WeightSyncAuditCallback(
            every_n_steps=EVERY, verbose=False, report_path=report_path, timeout_s=TIMEOUT_S, **case.options()
        )
    )
    if refused is not None:
        return None, refused
    model = HFNet(case.seed, ema=case.pattern == "ema")
    freeze(case, model)
    opt = build_optimizer(case, model)
    faults = Faults(case, rank, model)
    handles = faults.attach(opt)
    cap = Capture(model, opt)
    state: dict[str, Any] = {}
    cap.attach(opt, lambda: state["trainer"].state.global_step + 1)
    steps = _Steps(case, model, faults, cap)

    class Before(TrainerCallback):
        def on_step_begin(self, args: Any, st: Any, control: Any, **_: Any) -> None:
            steps.start(st.global_step + 1)

        def on_step_end(self, args: Any, st: Any, control: Any, **_: Any) -> None:
            steps.end(st.global_step)

    class After(TrainerCallback):
        def on_step_end(self, args: Any, st: Any, control: Any, **_: Any) -> None:
            steps.later(st.global_step)

    ids, y = _rows(case, world)
    args = TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), f"weightsync-pairs-{os.getppid()}"), use_cpu=True,
        save_strategy="no", report_to=[], disable_tqdm=True, logging_strategy="no", ddp_backend="gloo",
        ddp_broadcast_buffers=False, max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=2 if case.pattern == "accumulate" else 1,
        max_grad_norm=0.5 if case.pattern == "clip" else 0.0, bf16=case.pattern == "scaler",
        lr_scheduler_type="constant", seed=case.seed % 2**31,
    )  # fmt: skip
    rows = [{"ids": ids[i], "labels": y[i]} for i in range(len(ids))]
    trainer = Trainer(
        model=model, args=args, train_dataset=rows, callbacks=[Before(), audit, After()],
        optimizers=(opt, build_scheduler(case, opt)),
    )  # fmt: skip
    state["trainer"] = trainer
    return cap, finish(trainer.train, cap, faults, lambda: handles)
