"""What an every-step audit adds to a training step: none, synchronous, overlapped, sampled 1/8.

    python benchmarks/bench_step_overhead.py                 # both placements (~4 minutes on 2 cores)
    python benchmarks/bench_step_overhead.py --rounds 5 --batch 64 --json out.json

The same loop for every configuration: a ~20.5M-parameter MLP with Adam under DDP on 2 forked CPU gloo
ranks (one torch thread per rank), the same batch every step, audited after every ``optimizer.step()``:

- **none**: no audit;
- **sync**: ``LoopAudit(every_n_steps=1)``, the digest and the exchange inside the step;
- **overlap**: ``LoopAudit(every_n_steps=1, overlap=True)``, step s digested and compared on a worker
  thread while step s+1's forward and backward run, settled before its optimizer step;
- **sampled 1/8**: ``LoopAudit(every_n_steps=1, coverage="1/8")``, synchronous, an eighth of each large
  tensor per audit (every byte once in 8 steps);
- **overlap 1/8**: both: a rotating eighth of each large tensor (over 64 KiB) on the worker each step, small
  tensors whole every step: no byte goes unaudited longer than 8 steps.

Also printed: rank 0's CPU time per step (every thread of the process: training and the audit's; steadier
than wall time on a shared host) and the bytes each configuration's audit reads per step and rank (``overlap 1/8`` reads about an
eighth of what ``overlap`` reads: the worker's memory traffic, which competes with training's).

Two placements, each a separate run of both ranks:

- **a core free**: both ranks' training threads are pinned to core 0 (the audit's threads are not), so
  core 1 is free for the audit, as on a GPU machine whose training leaves host cores idle;
- **both cores busy**: nothing pinned; each rank's training thread takes a core, and the audit competes.

Configurations alternate in rounds (one block of ``--steps`` timed steps each per round, after one untimed
step that puts the overlapped audit in its steady state: one launch and one settle per timed step), so
slow phases of a shared machine hit every configuration alike; each ratio is the median block of a
configuration over the median block of ``none`` *in the same run*. Rank 0's wall time is reported (DDP's
all-reduce ties the ranks' steps together).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: F401 - first: it puts this checkout and tests/ on sys.path
import torch
import torch.distributed as dist
from harness import launch, machine, table
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from weightsync_audit import LoopAudit
from weightsync_audit.engine.hashing.reader import SMALL, sample_bounds

CONFIGS = ("none", "sync", "overlap", "sampled 1/8", "overlap 1/8")
DIMS = (1536, 4096, 3072, 512)  # 20.45M parameters; with Adam's two moments 245 MB audited per rank


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(DIMS):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _rank(rank: int, world: int, pin: bool, rounds: int, steps: int, batch: int, report_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = _mlp()
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(batch, DIMS[0], generator=torch.Generator().manual_seed(rank))
    y = torch.randn(batch, DIMS[-1], generator=torch.Generator().manual_seed(100 + rank))
    report = os.path.join(report_dir, "overlap.jsonl")
    audits: dict[str, LoopAudit | None] = {
        "none": None,
        "sync": LoopAudit(model, opt, every_n_steps=1, verbose=False),
        "overlap": LoopAudit(model, opt, every_n_steps=1, overlap=True, verbose=False, report_path=report),
        "sampled 1/8": LoopAudit(model, opt, every_n_steps=1, coverage="1/8", verbose=False),
        "overlap 1/8": LoopAudit(model, opt, every_n_steps=1, overlap=True, coverage="1/8", verbose=False),
    }
    step = 0

    def one_step(audit: LoopAudit | None) -> None:
        nonlocal step
        step += 1
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if audit is not None:
            audit.step(step)

    for audit in audits.values():  # warm up every path (manifests cached, worker and hashing threads made)
        for _ in range(3):
            one_step(audit)
        if audit is not None:
            audit.settle()
    if pin:  # this thread only (Linux: pid 0 is the calling thread); the threads made above keep both cores
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    blocks: dict[str, list[float]] = {c: [] for c in CONFIGS}
    cpu: dict[str, list[float]] = {c: [] for c in CONFIGS}  # this process's CPU time, every thread
    for r in range(rounds):
        order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
        for config in order:
            audit = audits[config]
            one_step(audit)  # untimed: the overlapped audit in its steady state
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                one_step(audit)
            blocks[config].append((time.perf_counter() - t0) / steps)
            cpu[config].append((time.process_time() - c0) / steps)
            if audit is not None:
                audit.settle()  # untimed: the last launch's verdict
    for audit in audits.values():
        if audit is not None:
            audit.close()
    return {"blocks": blocks, "cpu": cpu, "report": report, "read": read_per_step(net, opt)}


def read_per_step(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, float]:
    """Bytes an audit of every step reads per rank: every byte in full; in 1/8, small tensors whole and
    an eighth of each larger one (the mean over the 8 slices)."""
    tensors = [*net.parameters(), *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]
    full = sum(t.nbytes for t in tensors)
    eighth = 0.0
    for t in tensors:
        if t.nbytes <= SMALL:
            eighth += t.nbytes
        else:
            eighth += sum(b - a for a, b in (sample_bounds(t.numel(), i, 8) for i in range(8))) * t.element_size() / 8
    return {"full": full, "1/8": eighth}


def placement(pin: bool, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        out = launch(_rank, 2, pin, args.rounds, args.steps, args.batch, tmp)
        wall = time.perf_counter() - t0
        records = [json.loads(line) for line in Path(out[0]["report"]).read_text().splitlines() if line.strip()]
    blocks = out[0]["blocks"]
    med = {c: statistics.median(v) for c, v in blocks.items()}
    waited = [r["overlap"]["waited_ms"] for r in records]
    worker = [r["overlap"]["audit_ms"] for r in records]
    return {
        "pinned": pin,
        "median_step_ms": {c: m * 1e3 for c, m in med.items()},
        "median_cpu_ms": {c: statistics.median(v) * 1e3 for c, v in out[0]["cpu"].items()},
        "ratio_vs_none": {c: med[c] / med["none"] for c in CONFIGS},
        "blocks_ms": {c: [b * 1e3 for b in v] for c, v in blocks.items()},
        "overlap_waited_ms_median": statistics.median(waited) if waited else None,
        "overlap_audit_ms_median": statistics.median(worker) if worker else None,
        "in_sync": all(r["in_sync"] for r in records),
        "read_per_step": {c: 0 if c == "none" else out[0]["read"]["1/8" if "1/8" in c else "full"] for c in CONFIGS},
        "load": [load0, os.getloadavg()[0]],
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps per block (8: one rotation of 1/8)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--only", choices=("free", "busy"), default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    print(f"# {machine()}")
    print(f"# MLP {DIMS} (20.45M parameters) + Adam under DDP, 2 gloo ranks, batch {args.batch}, 1 torch thread/rank")
    runs = []
    for pin in (True, False):
        if args.only is not None and pin != (args.only == "free"):
            continue
        run = placement(pin, args)
        runs.append(run)
        rows = [
            [c, f"{run['read_per_step'][c] / 1e6:.1f}", f"{run['median_step_ms'][c]:.1f}", f"{run['ratio_vs_none'][c]:.3f}",
             f"{(run['ratio_vs_none'][c] - 1) * 100:+.1f}%",
             " ".join(f"{b:.0f}" for b in run["blocks_ms"][c]), f"{run['median_cpu_ms'][c]:.1f}",
             f"{run['median_cpu_ms'][c] / run['median_cpu_ms']['none']:.3f}"]
            for c in CONFIGS
        ]  # fmt: skip
        where = "a core free (training pinned to core 0)" if pin else "both cores busy (nothing pinned)"
        print(f"\n## {where}; load average {run['load'][0]:.1f} -> {run['load'][1]:.1f}; {run['wall_s']:.0f} s")
        print(
            table(
                [
                    "config",
                    "MB read/step/rank",
                    "step ms (median block)",
                    "ratio vs none",
                    "overhead",
                    "blocks (ms/step)",
                    "rank 0 CPU ms/step",
                    "CPU vs none",
                ],
                rows,
            )
        )
        print(
            f"overlap: the worker's audit {run['overlap_audit_ms_median']:.1f} ms (median), the step waited "
            f"{run['overlap_waited_ms_median']:.2f} ms for it (median); every record in sync: {run['in_sync']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
