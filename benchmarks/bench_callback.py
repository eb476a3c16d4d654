"""What ``WeightSyncAudit`` costs a real Lightning training run, as a share of step time.

    python benchmarks/bench_callback.py                  # 2 CPU ranks (ddp_fork), about 2 minutes
    python benchmarks/bench_callback.py --devices 1 --steps 500

The same small training run (an MLP with Adam on random data, so the audit covers parameters and twice
as much optimizer state) is fitted several times: without the callback, with ``WeightSyncAudit()`` at
its defaults (every 100 steps, plus at train start and epoch end), and with an audit at every step,
full and sampled (``coverage="1/8"``). Two figures per configuration:

- *audit share*: the time the callback reports for its audits (``weightsync/audit_ms``, captured by a
  logger) over the training time: the cost attributable to the audit alone;
- *step time*: median and mean wall time between consecutive batch starts on rank 0, and the mean's
  change against the run without the callback (this includes noise from the machine).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from harness import machine, table
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

os.environ.setdefault("PL_DISABLE_FORK", "0")
warnings.filterwarnings("ignore")
for _name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
    logging.getLogger(_name).setLevel(logging.ERROR)

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.loggers import Logger  # noqa: E402

from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit  # noqa: E402

WIDTH = 1024
IN, OUT = 256, 16


class Net(pl.LightningModule):
    """An MLP of 1.3M parameters (and twice that in Adam state): small, so fixed costs show."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(IN, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, OUT)
        )

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # one core per rank, as a real CPU DDP job would pin it

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class AuditTimes(Logger):
    """Captures the callback's ``weightsync/audit_ms`` metric (logged on global rank zero)."""

    def __init__(self) -> None:
        super().__init__()
        self.audit_ms: list[float] = []

    @property
    def name(self) -> str:
        return "audit-times"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if "weightsync/audit_ms" in metrics:
            self.audit_ms.append(float(metrics["weightsync/audit_ms"]))


class StepClock(pl.Callback):
    """Wall time between batch starts on rank zero; writes everything to ``out`` when training ends."""

    def __init__(self, out: str, logger: AuditTimes) -> None:
        self.out = out
        self.logger = logger
        self.starts: list[float] = []
        self.t_fit = 0.0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.t_fit = time.perf_counter()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        end = time.perf_counter()
        if trainer.is_global_zero:
            steps = [b - a for a, b in zip(self.starts, [*self.starts[1:], end])]
            Path(self.out).write_text(
                json.dumps({"steps": steps[5:], "train_s": end - self.t_fit, "audit_ms": self.logger.audit_ms})
            )


def fit(config: str, steps: int, devices: int, batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    n = steps * batch * devices
    data = TensorDataset(torch.randn(n, IN), torch.randint(0, OUT, (n,)))
    logger = AuditTimes()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    callbacks: list[pl.Callback] = [StepClock(out, logger)]
    if config == "defaults":
        callbacks.append(WeightSyncAudit(verbose=False))
    elif config == "every step":
        callbacks.append(WeightSyncAudit(every_n_train_steps=1, verbose=False))
    elif config == "every step, 1/8":
        callbacks.append(WeightSyncAudit(every_n_train_steps=1, coverage="1/8", verbose=False))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp_fork" if devices > 1 else "auto",
        max_epochs=1,
        max_steps=steps,
        logger=logger,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Net(), DataLoader(data, batch_size=batch, shuffle=False))
    result = json.loads(Path(out).read_text())
    Path(out).unlink()
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    params = sum(q.numel() for q in Net().parameters())
    print(f"# {machine()}")
    print(
        f"# MLP with {params / 1e6:.2f}M parameters + Adam (audited: {3 * params * 4 / 1e6:.0f} MB), "
        f"batch {args.batch}, {args.steps} steps, {args.devices} CPU rank(s)",
        flush=True,
    )
    configs = ["none", "defaults", "every step", "every step, 1/8"]
    results = {}
    for c in configs:
        results[c] = fit(c, args.steps, args.devices, args.batch)
        r = results[c]
        print(f"  {c}: {len(r['audit_ms'])} audits, train {r['train_s']:.1f}s", flush=True)
    base = statistics.mean(results["none"]["steps"])
    rows = []
    for c in configs:
        r = results[c]
        steps = r["steps"]
        mean, med = statistics.mean(steps), statistics.median(steps)
        audit_s = sum(r["audit_ms"]) / 1e3
        rows.append(
            [
                c,
                str(len(r["audit_ms"])),
                f"{statistics.median(r['audit_ms']):.1f}" if r["audit_ms"] else "-",
                f"{100 * audit_s / r['train_s']:.2f}%" if r["audit_ms"] else "-",
                f"{med * 1e3:.1f}",
                f"{mean * 1e3:.1f}",
                f"{100 * (mean - base) / base:+.1f}%" if c != "none" else "-",
            ]
        )
    print()
    print(
        table(
            [
                "config",
                "audits",
                "audit ms (median)",
                "audit share of training time",
                "step ms (median)",
                "step ms (mean)",
                "mean step vs none",
            ],
            rows,
        )
    )
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "params": params, "results": results}))


if __name__ == "__main__":
    main()
