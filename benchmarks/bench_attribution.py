"""What attribution costs per training step, against the same step without it, measured in one run.

    python benchmarks/bench_attribution.py                       # 2 gloo ranks, 8.4M-parameter MLP, Adam
    python benchmarks/bench_attribution.py --width 2048 --layers 5 --batch 256 --rounds 9

Each rank trains a plain DDP + Adam loop (forward, backward with DDP's all-reduce, ``optimizer.step``) and
times steps, slowest rank counted; each configuration wraps the same model in a DDP of its own (a
communication hook cannot be removed) and marks each step as ``LoopAudit`` does (``attribution.mark``), no
audit in the loop (an audit's own cost is in bench_audit.py). The configurations take turns, ``--steps``
steps each after 2 of warm-up, ``--rounds`` times; each ratio is the median over rounds of the
configuration's median step over that round's ``none``:

- ``none``: no attribution (the baseline, measured first and again last: the noise);
- ``at_rest``: digests of the parameters and Adam's state right after each step and right before the next;
- ``+collective``: also the DDP comm hook digesting each reduced bucket, and the gradients before the step;
- ``+recheck/8``: also the replay of 1 parameter in 8 (rotating) from a pre-step copy, no byte budget;
- ``recheck/1 unbounded``: every update replayed, no byte budget (what ``attribution=True`` was);
- ``attribution=True``: at rest, collective, and the replay within its budget (16 MiB copied per step);
- ``at_rest offloaded`` and ``attribution=True offloaded``: the same with the at-rest reads on a worker
  thread (what ``overlap=True`` sets): the training thread keeps the structure check, the small tensors and
  the version counters.
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
from weightsync_audit.engine.attribution import check_attribution
from weightsync_audit.engine.attribution.settle import attach_watch
from weightsync_audit.engine.config import AuditConfig

ATTRIBUTION = check_attribution(True)
CONFIGS: dict[str, tuple[AttributionConfig | None, bool]] = {
    "none": (None, False),
    "at_rest": (AttributionConfig(at_rest=True), False),
    "+collective": (AttributionConfig(at_rest=True, collective=True), False),
    "+recheck/8": (AttributionConfig(at_rest=True, collective=True, recheck=8, recheck_bytes=0), False),
    "recheck/1 unbounded": (AttributionConfig(at_rest=True, collective=True, recheck=1, recheck_bytes=0), False),
    "attribution=True": (ATTRIBUTION, False),
    "at_rest offloaded": (AttributionConfig(at_rest=True), True),
    "attribution=True offloaded": (ATTRIBUTION, True),
    "none again": (None, False),
}
"""Configuration -> (what the watch records, whether its at-rest reads are offloaded)."""


def step_times(
    rank: int, world: int, width: int, layers: int, batch: int, steps: int, rounds: int, device: str = "cpu"
) -> dict[str, Any]:
    """Per configuration, the median step seconds (slowest rank) of each round and its ratio to that round's
    ``none``, with the model on ``device``; ``moved_at_rest``: the tensors a healthy loop's watch saw change
    at rest (none, for a right answer). The configurations take turns, ``steps`` steps each, ``rounds`` times,
    so that a change of load on the machine falls on every configuration alike."""
    dev = torch.device(device)
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU()))).to(dev)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank)).to(dev)
    runs: dict[str, tuple[DDP, torch.optim.Optimizer, Any]] = {}
    for name, (cfg, offload) in CONFIGS.items():
        ddp = DDP(model)  # one per configuration: a communication hook cannot be removed
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-6)
        watch = None
        if cfg is not None:
            watch = attach_watch(Auditor(ddp, opt, config=AuditConfig(attribution=cfg)), ddp, [opt], offload=offload)
        runs[name] = (ddp, opt, watch)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    on_thread: dict[str, list[float]] = {name: [] for name in CONFIGS}
    ratios: dict[str, list[float]] = {name: [] for name in CONFIGS}
    moved: list[str] = []
    for _ in range(rounds):
        for name, (ddp, opt, watch) in runs.items():
            took = []
            spent = 0.0
            for step in range(steps + 2):
                if step == 2 and watch is not None:
                    spent = watch.hook_s + watch.reduced.hook_s
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                ddp(x).square().mean().backward()
                opt.step()
                if watch is not None:
                    watch.mark(step)
                compat.synchronize(dev)
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is over when the slowest rank is done
                took.append(float(t))
            if watch is not None:
                spent = watch.hook_s + watch.reduced.hook_s - spent
                # the first step of a turn compares with the last of the turn before, which the other
                # configurations' steps have moved since: not a change at rest
                moved += [f"{name}: {n}" for r in list(watch.records)[1:] for n in r.rest]
                watch.records.clear()
                if watch.rest is not None and watch.rest.reader is not None:
                    watch.rest.reader.collect()  # no read left waiting while the next configuration runs
            t = torch.tensor([spent / steps])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            on_thread[name].append(float(t))
            times[name].append(median(took[2:]))
        for name in CONFIGS:
            ratios[name].append(times[name][-1] / times["none"][-1])
    for _, _, watch in runs.values():
        if watch is not None:
            watch.detach()
    return {"times": {k: median(v) for k, v in times.items()}, "ratios": {k: median(v) for k, v in ratios.items()},
            "on_thread": {k: median(v) for k, v in on_thread.items()}, "moved_at_rest": moved}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per configuration and round")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    params = a.layers * (a.width * a.width + a.width)
    got: Any = launch(step_times, 2, a.width, a.layers, a.batch, a.steps, a.rounds)[0]
    res, ratios, moved, spent = got["times"], got["ratios"], got["moved_at_rest"], got["on_thread"]
    base = res["none"]
    rows = [[k, f"{v * 1e3:.1f}", f"{ratios[k]:.3f}", f"{spent[k] * 1e3:.2f}", f"{100 * spent[k] / base:.1f}%"]
            for k, v in res.items()]  # fmt: skip
    print(f"attribution per step, 2 gloo ranks, {params / 1e6:.1f}M params, Adam, batch {a.batch}, {a.rounds} rounds "
          f"of {a.steps} steps; {machine()}")  # fmt: skip
    heads = ["configuration", "step ms (median, slowest rank)", "x none (median over rounds)",
             "attribution's ms per step on the training thread", "of the none step"]  # fmt: skip
    print(table(heads, rows))
    print("changed at rest in these healthy runs (must be none):", moved or "none")


if __name__ == "__main__":
    main()
