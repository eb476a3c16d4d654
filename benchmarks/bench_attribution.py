"""What attribution costs per training step, against the same step without it, measured in one run.

    python benchmarks/bench_attribution.py                       # 2 gloo ranks, 8.4M-parameter MLP, Adam
    python benchmarks/bench_attribution.py --width 2048 --layers 5 --batch 256 --steps 20

Each rank trains a plain DDP + Adam loop (forward, backward with DDP's all-reduce, ``optimizer.step``) and
times steps, slowest rank counted, median of ``--steps`` after warm-up; each configuration wraps the
same model in a fresh DDP (a communication hook cannot be removed) and marks each step as ``LoopAudit``
does (``attribution.mark``), no audit in the loop (an audit's own cost is in bench_audit.py):

- ``none``: no attribution (the baseline, measured first and again last: the noise);
- ``at_rest``: digests of the parameters and Adam's state right after each step and right before the next;
- ``+collective``: also the DDP comm hook digesting each reduced bucket, and the gradients before the step;
- ``+recheck/8``: also the replay of 1 parameter in 8 (rotating) from a pre-step copy;
- ``recheck/1``: every update replayed (``attribution=True``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from harness import launch, machine, median, table
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from weightsync_audit import AttributionConfig, Auditor, compat
from weightsync_audit.engine.attribution.attach import attach_watch
from weightsync_audit.engine.config import AuditConfig

CONFIGS: dict[str, AttributionConfig | None] = {
    "none": None,
    "at_rest": AttributionConfig(at_rest=True),
    "+collective": AttributionConfig(at_rest=True, collective=True),
    "+recheck/8": AttributionConfig(at_rest=True, collective=True, recheck=8),
    "recheck/1": AttributionConfig(at_rest=True, collective=True, recheck=1),
    "none again": None,
}


def step_times(
    rank: int, world: int, width: int, layers: int, batch: int, steps: int, device: str = "cpu"
) -> dict[str, Any]:
    """This rank's ``times`` (configuration -> median step seconds, slowest rank) with the model on ``device``,
    and ``moved_at_rest``: the tensors a healthy loop's watch saw change at rest (none, for a right answer)."""
    dev = torch.device(device)
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU()))).to(dev)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank)).to(dev)
    out: dict[str, float] = {}
    moved: list[str] = []
    for name, cfg in CONFIGS.items():
        ddp = DDP(model)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
        watch = None
        if cfg is not None:
            auditor = Auditor(ddp, opt, config=AuditConfig(attribution=cfg))
            watch = attach_watch(auditor, ddp, [opt])
        times = []
        for step in range(steps + 3):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
            if watch is not None:
                watch.mark(step)
            compat.synchronize(dev)
            times.append(time.perf_counter() - t0)
        if watch is not None:
            moved += [f"{name}: {n}" for r in watch.records for n in r.get("rest") or ()]
            watch.detach()
        t = torch.tensor([median(times[3:])])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = float(t)
    return {"times": out, "moved_at_rest": moved}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    params = a.layers * (a.width * a.width + a.width)
    res: Any = launch(step_times, 2, a.width, a.layers, a.batch, a.steps)[0]["times"]
    base = res["none"]
    rows = [[k, f"{v * 1e3:.1f}", f"{v / base:.3f}"] for k, v in res.items()]
    print(f"attribution per step, 2 gloo ranks, {params / 1e6:.1f}M params, Adam, batch {a.batch}; {machine()}")
    print(table(["configuration", "step ms (median, slowest rank)", "x none"], rows))


if __name__ == "__main__":
    main()
