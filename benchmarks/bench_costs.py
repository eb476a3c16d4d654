"""What each part of the audit costs per training step, every ratio against no audit measured in the same run.

    python benchmarks/bench_costs.py                          # 2 gloo ranks, 8.4M-parameter MLP, Adam (~2 min)
    python benchmarks/bench_costs.py --rounds 5 --placement busy --json costs.json

One plain DDP + Adam loop per configuration, each on its own copy of the same model (a DDP comm hook and an
optimizer's step hooks cannot be removed), on 2 forked CPU gloo ranks, one torch thread per rank:

- ``none``: no audit, no attribution (the baseline);
- ``audit/step``: ``LoopAudit(every_n_steps=1)``, the at-rest check of every byte after every step, inside it;
- ``audit/step, overlap``: the same with ``overlap=True`` (digest and exchange under the next forward/backward);
- ``audit/100``: ``LoopAudit(every_n_steps=100)``, the cadence of a long run (no audit falls in a timed block:
  what it costs between audits);
- ``attribution at_rest``: ``attribution={"at_rest": True}``, no audit in the loop: two digests per step;
- ``+collective``: also the DDP hook's digests of each reduced bucket and of the gradients before the step;
- ``attribution=True``: at rest, collective and every update replayed (``recheck=1``);
- ``attribution=True + overlap audit/step``: everything on, as the issue asks to make cheap.

Configurations alternate in rounds (one block of ``--steps`` timed steps each, the order reversed every other
round, after one untimed step), so the slow phases of a shared machine hit every configuration alike; each
ratio is a configuration's median block over the median block of ``none``. Rank 0's wall time is reported
(DDP's all-reduce ties the ranks' steps together). ``--placement free`` pins each rank's training thread to
core 0 (the audit's threads keep both cores: a host core free, as on a GPU machine); ``busy`` pins nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: F401 - first: it puts this checkout and tests/ on sys.path
import torch
from harness import launch, machine, table
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

CONFIGS: dict[str, dict[str, Any]] = {
    "none": {},
    "audit/step": {"every_n_steps": 1},
    "audit/step, overlap": {"every_n_steps": 1, "overlap": True},
    "audit/100": {"every_n_steps": 100},
    "attribution at_rest": {"attribution": {"at_rest": True}},
    "+collective": {"attribution": {"at_rest": True, "collective": True}},
    "attribution=True": {"attribution": True},
    "attribution=True + overlap audit/step": {"attribution": True, "every_n_steps": 1, "overlap": True},
}


def _mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def _rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from weightsync_audit import LoopAudit

    x = torch.randn(args["batch"], args["width"], generator=torch.Generator().manual_seed(rank))
    y = torch.randn(args["batch"], args["width"], generator=torch.Generator().manual_seed(100 + rank))
    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer, Any]] = {}
    for name, kw in CONFIGS.items():
        model = DDP(_mlp(args["width"], args["layers"]))
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        audit = LoopAudit(model, opt, verbose=False, **kw) if kw else None
        runs[name] = (model, opt, audit)
    step = {name: 0 for name in CONFIGS}

    def one_step(name: str) -> None:
        model, opt, audit = runs[name]
        step[name] += 1
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if audit is not None:
            audit.step(step[name])

    for name in CONFIGS:  # warm up every path: manifests cached, hooks set, worker and hashing threads made
        for _ in range(3):
            one_step(name)
    if args["placement"] == "free":  # this thread only (Linux: pid 0 is the calling thread)
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    names = list(CONFIGS)
    blocks: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args["rounds"]):
        for name in names if r % 2 == 0 else names[::-1]:
            one_step(name)  # untimed: an overlapped audit in its steady state
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args["steps"]):
                one_step(name)
            blocks[name].append((time.perf_counter() - t0) / args["steps"])
            audit = runs[name][2]
            if audit is not None:
                audit.settle()  # untimed: the last launch's verdict
    in_sync = True
    for _, _, audit in runs.values():
        if audit is not None:
            audit.close()
            in_sync = in_sync and audit.history.first_divergence_step is None
    return {"blocks": blocks, "in_sync": in_sync}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps per block")
    p.add_argument("--placement", choices=("free", "busy"), default="free")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    params = args.layers * (args.width * args.width + args.width)
    print(f"# {machine()}")
    print(f"# MLP {args.layers} x Linear({args.width}, {args.width}) ({params / 1e6:.1f}M parameters) + Adam, DDP, "
          f"2 gloo ranks, batch {args.batch}, placement {args.placement}")  # fmt: skip
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    out = launch(_rank, 2, vars(args))[0]
    med = {n: statistics.median(v) for n, v in out["blocks"].items()}
    rows = [
        [n, f"{med[n] * 1e3:.1f}", f"x{med[n] / med['none']:.3f}", " ".join(f"{b * 1e3:.0f}" for b in out["blocks"][n])]
        for n in CONFIGS
    ]
    print(f"# load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; {time.perf_counter() - t0:.0f} s; "
          f"every audit in sync: {out['in_sync']}")  # fmt: skip
    print(table(["configuration", "step ms (median block)", "x none (same run)", "blocks (ms/step)"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "args": vars(args), **out}, indent=1))


if __name__ == "__main__":
    main()
