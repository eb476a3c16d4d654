"""Run under ``torchrun`` on 2 ranks: the Hugging Face Trainer callback, Fabric, Accelerate and a bare DDP loop.

One launch runs every scenario in turn (importing ``transformers`` is the slow part, paid once); each
rank writes ``OUT/<scenario>.rank<r>.json`` with what it saw, and tests/test_integrations.py judges.
The tests launch it as two one-process "nodes" (every local rank 0), so global ranks are checked too.
Usage: torchrun --nnodes=2 --nproc_per_node=1 --node-rank=N ... trainers_run.py OUT_DIR [SCENARIO ...]
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared Trainer set-up
from hf_setup import go_offline, training_args

go_offline()  # no hub, no trackers: before `transformers` is imported (the test sets them too)

import adapter_parity_run  # noqa: E402 - beside this script: one fault under each adapter, scenarios here too
import hf_resume_run  # noqa: E402 - beside this script: resume fidelity per rank
import hf_unfreeze_run  # noqa: E402 - beside this script: its two runs are scenarios here too

from weightsync_audit import WeightDivergenceError  # noqa: E402
from weightsync_audit.transformers import WeightSyncAuditCallback  # noqa: E402

warnings.filterwarnings("ignore")

OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {}


def scenario(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


# -- the Hugging Face Trainer -------------------------------------------------------------------


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16))


class BNNet(nn.Module):
    """A BatchNorm model the Trainer can train: ``forward`` returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.head(self.body(x)).squeeze(-1), labels)}


def tokens() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (64, 8), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def features() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 8, generator=g) * 3 + 1
    return [{"x": row, "labels": row.sum()} for row in x]


class At(__import__("transformers").TrainerCallback):
    """Does ``act(model, optimizer)`` on ``ranks`` at one event of one step (``None``: of every step): a planted
    fault, or a clock."""

    def __init__(
        self, event: str, step: int | None, act: Callable[[nn.Module, Any], None], ranks: tuple[int, ...] = (1,)
    ) -> None:
        self.step = step
        self.act = act

        def fire(args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw: Any) -> None:
            if RANK in ranks and self.step in (None, state.global_step):
                with torch.no_grad():
                    self.act(model, optimizer)

        setattr(self, event, fire)


class Clock(At):
    """An ``At`` that only notes the time (its own class: the Trainer warns about two of one class)."""


def train(model: nn.Module, data: list[dict[str, torch.Tensor]], callbacks: list[Any], **overrides: Any) -> Any:
    from transformers import Trainer

    kwargs: dict[str, Any] = {
        "output_dir": OUT / "trainer", "max_steps": 6, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
        "logging_steps": 1, "seed": 0, **overrides,
    }  # fmt: skip
    trainer = Trainer(model=model, args=training_args(gloo=True, **kwargs), train_dataset=data, callbacks=callbacks)
    trainer.train()
    return trainer


def records(path: Path) -> list[dict[str, Any]]:
    dist.barrier()
    return [json.loads(line) for line in path.read_text().splitlines()] if RANK == 0 else []


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def nudge_head(model: nn.Module, optimizer: Any) -> None:
    model.transformer.h[1].mlp.c_fc.weight[0, 0] += 1e-3


@scenario
def hf_healthy() -> dict[str, Any]:
    path = OUT / "hf_healthy.jsonl"
    cb = WeightSyncAuditCallback(
        every_n_steps=1, include=("params", "buffers", "optimizer", "grads"), report_path=str(path)
    )
    trainer = train(gpt2(), tokens(), [cb])
    logged = [e for e in trainer.state.log_history if "weightsync/in_sync" in e]
    return {"records": records(path), "logged": logged, "summary": cb.summary()}


@scenario
def hf_checkpoint() -> dict[str, Any]:
    """Save at step 3 (a sidecar in checkpoint-3), then resume from it with rank 1 holding another head."""
    from transformers import Trainer

    path, out_dir = OUT / "hf_checkpoint.jsonl", OUT / "hf_ckpt"
    cb = WeightSyncAuditCallback(every_n_steps=None, report_path=str(path))
    train(gpt2(), tokens(), [cb], output_dir=str(out_dir), save_strategy="steps", save_steps=3, max_steps=3)
    saved = records(path)
    args = training_args(out_dir, gloo=True, max_steps=4, per_device_train_batch_size=4, seed=0)
    plant = At("on_train_begin", 3, nudge_head)
    cb = WeightSyncAuditCallback(every_n_steps=None, report_path=str(path))
    trainer = Trainer(model=gpt2(), args=args, train_dataset=tokens(), callbacks=[plant, cb])
    trainer.train(resume_from_checkpoint=str(out_dir / "checkpoint-3"))
    return {"saved": saved, "resumed": records(path)[len(saved) :], "folder": str(out_dir / "checkpoint-3")}


@scenario
def hf_raise() -> dict[str, Any]:
    cb = WeightSyncAuditCallback(every_n_steps=1, on_mismatch="raise", timeout_s=30)
    nudged: list[float] = []
    clock = Clock("on_step_end", 3, lambda model, opt: nudged.append(time.monotonic()), ranks=(0, 1))
    try:
        train(gpt2(), tokens(), [clock, At("on_step_end", 3, nudge_head), cb])
    except WeightDivergenceError as exc:
        return {"raised": "WeightDivergenceError", "message": str(exc), "step": exc.result.step,
                "names": exc.result.diverged_names, "ranks": [m.ranks for m in exc.result.mismatches],
                "seconds_after_the_nudge": time.monotonic() - nudged[0]}  # fmt: skip
    return {"raised": None}


@scenario
def hf_resync() -> dict[str, Any]:
    path = OUT / "hf_resync.jsonl"
    cb = WeightSyncAuditCallback(every_n_steps=1, on_mismatch="resync", report_path=str(path))
    trainer = train(gpt2(), tokens(), [At("on_step_end", 3, nudge_head), cb])
    mine = weights_digest(trainer.model)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"records": records(path), "digests": every}


@scenario
def hf_pinpoint() -> dict[str, Any]:
    path = OUT / "hf_pinpoint.jsonl"
    cb = WeightSyncAuditCallback(every_n_steps=5, pinpoint=True, report_path=str(path), verbose=False)
    train(gpt2(), tokens(), [At("on_step_end", 3, nudge_head), cb])
    return {"records": records(path)}


@scenario
def hf_batchnorm() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, policy in (("default", None), ("no_broadcast", False)):
        path = OUT / f"hf_batchnorm_{label}.jsonl"
        cb = WeightSyncAuditCallback(every_n_steps=1, report_path=str(path), verbose=False)
        train(BNNet(), features(), [cb], ddp_broadcast_buffers=policy, max_steps=3)
        out[label] = records(path)
    return out


def double_lr(model: nn.Module, optimizer: Any) -> None:
    optimizer.param_groups[0]["lr"] *= 2


@scenario
def hf_lr() -> dict[str, Any]:
    path = OUT / "hf_lr.jsonl"
    cb = WeightSyncAuditCallback(
        every_n_steps=1, include=("params", "optimizer", "grads"), report_path=str(path), verbose=False
    )
    train(gpt2(), tokens(), [At("on_step_begin", 2, double_lr), cb], max_steps=4)
    return {"records": records(path)}


class LrProbe(__import__("transformers").TrainerCallback):
    """Each rank's ``lr`` as the optimizer step reads it (``on_pre_optimizer_step``) and after the scheduler
    stepped (``on_step_end``), by the step the optimizer step completes: the truth the records are judged by."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[int, float]] = {"pre_step": {}, "step_end": {}}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
        self.seen["pre_step"][state.global_step + 1] = optimizer.param_groups[0]["lr"]

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
        self.seen["step_end"][state.global_step] = optimizer.param_groups[0]["lr"]

    def every_rank(self) -> list[dict[str, dict[int, float]]]:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, self.seen)
        return every


def printed_console() -> Any:
    """A console for the runner's printed reports, read back afterwards (what rank 0 would print)."""
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), width=10_000, soft_wrap=True)


@scenario
def hf_lr_at_step_only() -> dict[str, Any]:
    """Default ``include`` (no gradient audit): rank 1 doubles its lr for step 3 only; the scheduler sets it back
    before ``on_step_end``, so only the lr the step read tells why the parameters parted."""
    path = OUT / "hf_lr_at_step_only.jsonl"
    probe = LrProbe()
    cb = WeightSyncAuditCallback(every_n_steps=1, report_path=str(path), verbose=False)
    train(gpt2(), tokens(), [At("on_step_begin", 2, double_lr), probe, cb], max_steps=5)
    return {"records": records(path), "lr": probe.every_rank()}


def lr_every_step(on_mismatch: str) -> dict[str, Any]:
    """Rank 1 doubles its lr before every step (the scheduler sets it back after each), audited with gradients."""
    path = OUT / f"hf_lr_every_step_{on_mismatch}.jsonl"
    cb = WeightSyncAuditCallback(
        every_n_steps=1, include=("params", "buffers", "optimizer", "grads"), on_mismatch=on_mismatch,
        report_path=str(path),
    )  # fmt: skip
    cb.runner.console = printed_console()
    ranks_doubling = At("on_step_begin", None, double_lr)
    probe = LrProbe()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        train(gpt2(), tokens(), [ranks_doubling, probe, cb], max_steps=8)
    return {
        "records": records(path),
        "printed": cb.runner.console.file.getvalue(),
        "warned": [str(w.message) for w in warned if "weightsync" in str(w.message)],
        "lr": probe.every_rank(),
    }


@scenario
def hf_lr_every_step_warn() -> dict[str, Any]:
    return lr_every_step("warn")


@scenario
def hf_lr_every_step_resync() -> dict[str, Any]:
    return lr_every_step("resync")


# -- plain loops: Lightning Fabric, Accelerate, bare torchrun ------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(8, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * RANK + step))


def four_steps(
    model: nn.Module,
    optimizer: Any,
    backward: Callable[[torch.Tensor], None],
    rank: int,
    plant: Callable[[], None],
    audit_at: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """Four steps of ``model`` on this rank's batches, ``plant()`` on ``rank`` 1 after step 2's update, and each
    step's ``audit_at(step)`` result (by default ``audit(model, optimizer, ...)``); ``backward`` and ``rank`` are
    the loop framework's own."""
    from weightsync_audit import audit

    results = []
    for step in range(4):
        backward(model(batch(step)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        if step == 2 and rank == 1:
            with torch.no_grad():
                plant()
        result = audit(model, optimizer, step=step, timeout_s=60) if audit_at is None else audit_at(step)
        results.append(result.to_dict())
    return {"results": results, "wrapper": type(model).__name__}


@scenario
def fabric_loop() -> dict[str, Any]:
    from lightning.fabric import Fabric

    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    fabric = Fabric(accelerator="cpu", devices=per_node, num_nodes=dist.get_world_size() // per_node, strategy="ddp")
    fabric.launch()
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))

    def plant() -> None:
        model.head.bias[0] += 1e-3

    return four_steps(model, optimizer, fabric.backward, fabric.global_rank, plant)


@scenario
def accelerate_loop() -> dict[str, Any]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    net = Net()
    model, optimizer = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))

    def plant() -> None:
        net.backbone.bias[0] += 1e-3

    return four_steps(model, optimizer, accelerator.backward, accelerator.process_index, plant)


@scenario
def torchrun_loop() -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from weightsync_audit import Auditor

    model = DDP(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    auditor = Auditor(model, optimizer, timeout_s=60)

    def plant() -> None:
        model.module.backbone.weight[0, 0] += 1e-3

    return four_steps(model, optimizer, torch.Tensor.backward, RANK, plant, lambda step: auditor.audit(step=step))


# -- a layer unfrozen under the Trainer's own DDP wrap (hf_unfreeze_run.py; tests/test_hf_unfreeze.py) --------


@scenario
def hf_unfreeze_bug() -> dict[str, Any]:
    return hf_unfreeze_run.run("bug")


@scenario
def hf_unfreeze_fix() -> dict[str, Any]:
    return hf_unfreeze_run.run("fix")


@scenario
def hf_resume() -> dict[str, Any]:
    return hf_resume_run.run(OUT)


# -- one planted fault under each adapter (adapter_parity_run.py; tests/test_adapter_parity.py), last ---------


@scenario
def parity_loop() -> dict[str, Any]:
    return adapter_parity_run.run("loop")


@scenario
def parity_lightning() -> dict[str, Any]:
    return adapter_parity_run.run("lightning")


@scenario
def parity_hf() -> dict[str, Any]:
    return adapter_parity_run.run("hf")


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    faulthandler.dump_traceback_later(
        float(os.environ.get("TRAINERS_RUN_DEADLINE_S", "240")), exit=True
    )  # a hang shows where
    # One process group for every scenario; the Trainer, Accelerate and Fabric all find it initialised.
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    where = {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node": int(os.environ["GROUP_RANK"]),
    }
    chosen = sys.argv[2:] or list(SCENARIOS)
    for name in chosen:
        t0 = time.monotonic()
        try:
            out = SCENARIOS[name]()
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names the scenario
            out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        out.update(where, seconds=time.monotonic() - t0)
        (OUT / f"{name}.rank{RANK}.json").write_text(json.dumps(out, default=str))
    dist.barrier()
    dist.destroy_process_group()
