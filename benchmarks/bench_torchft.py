"""What an audit at committed steps costs a torchft training loop: audited steps against unaudited ones.

    python benchmarks/bench_torchft.py                  # 2 replica groups, the two models below
    python benchmarks/bench_torchft.py --steps 80

Each replica group is its own process (tests/torchft_jobs.py: a real lighthouse, real Managers, torchft's
DDP and Adam, batches of 8), auditing every other committed step (``every_n_steps=2``), so that audited
and unaudited steps alternate in the same run and share its load. ``step ms`` is the median wall time of
an unaudited loop iteration (forward, backward, torchft's all-reduce, the optimizer step), ``audited`` that
of an audited one (the audit runs in the optimizer step's pre-hook), from step 4 on, both replicas;
``added`` their difference, over the unaudited step. ``audit ms`` is the median ``duration_ms`` of the
records: the roll call in the quorum's store, which also absorbs the replicas' skew (without an audit the
next all-reduce waits it out instead), and the audit over the channel, used again while the quorum's
members stay the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness import machine, table
from torchft_jobs import Replica, run_job

MODELS = {"tiny (450 params)": {"width": 64}, "4 x Linear(1024,1024)": {"square": 1024}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    rows: list[list[Any]] = []
    for name, shape in MODELS.items():
        res = run_job([Replica(0), Replica(1)], steps=args.steps, every=2, timeout_s=30.0, deadline_s=600.0, **shape)
        audited = {x["step"] for r in res.values() for x in r["records"]}
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in res.values():
            for step, seconds in r["step_s"]:
                if step >= 4:
                    times[step in audited].append(seconds * 1e3)
        bare, with_audit = statistics.median(times[False]), statistics.median(times[True])
        audit_ms = statistics.median(x["duration_ms"] for r in res.values() for x in r["records"] if x["step"] >= 4)
        rows.append([name, f"{bare:.1f}", f"{with_audit:.1f}", f"{with_audit - bare:+.1f} ({100 * (with_audit - bare) / bare:+.1f}%)",
                     f"{audit_ms:.2f}", str(len(times[True]))])  # fmt: skip
    print(machine())
    print("2 replica groups of 1 process; Adam; an audit every other committed step; medians from step 4 on")
    print(table(["model", "step ms", "audited step ms", "added ms", "audit ms", "audited steps"], rows))


if __name__ == "__main__":
    main()
