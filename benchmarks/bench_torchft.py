"""What an audit across torchft replica groups costs, against the same audit in one torch.distributed world.

    python benchmarks/bench_torchft.py                  # 2 replica groups, the model sizes below
    python benchmarks/bench_torchft.py --steps 30

Each replica group is its own process (tests/torchft_jobs.py: a real lighthouse, real Managers, torchft's
DDP and Adam) and audits at every committed step (``every_n_steps=1``). ``torchft`` is the median
``duration_ms`` of those records: the roll call in the quorum's store, a gloo group of the members made for
the audit, and the audit's phases over it. ``world`` is the baseline, in the same run: the same model and
Adam state audited by ``Auditor.audit()`` on 2 forked gloo ranks of one world, whose channel is opened
once and reused. ``torchft - world`` is what meeting through the quorum adds per audit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch
from harness import launch, machine, median, table, timed
from torchft_jobs import Replica, _model, run_job

from weightsync_audit import Auditor

WIDTHS = {"450 params": 64, "2.8M params": 400_000}


def _world_rank(rank: int, world: int, width: int, reps: int) -> float:
    model = _model(seed=100, width=width)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    auditor = Auditor(model, opt)
    auditor.setup()
    return median(timed(lambda: auditor.audit(step=0), reps))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    rows: list[list[Any]] = []
    for name, width in WIDTHS.items():
        res = run_job([Replica(0), Replica(1)], steps=args.steps, every=1, width=width, timeout_s=30.0)
        ms = [r["duration_ms"] for r in res[(0, 0)]["records"] if r["in_sync"] and r["step"] >= 2]
        torchft_ms = statistics.median(ms)
        world_ms = max(launch(_world_rank, 2, width, args.steps)) * 1e3
        rows.append([name, str(len(ms)), f"{torchft_ms:.1f}", f"{world_ms:.1f}", f"{torchft_ms - world_ms:.1f}"])
    print(machine())
    print("2 replica groups of 1 process; Adam; medians (torchft: of the audits at steps >= 2)")
    print(table(["model", "audits", "torchft ms", "world ms", "torchft - world ms"], rows))


if __name__ == "__main__":
    main()
