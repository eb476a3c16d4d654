"""What an audit at committed steps costs a torchft training loop: audited steps against unaudited ones.

    python benchmarks/bench_torchft.py                  # 2 replica groups, the models below
    python benchmarks/bench_torchft.py --model linear --steps 160 --coverage 1 1/8

Each replica group is its own process (tests/torchft_jobs.py: a real lighthouse, real Managers, torchft's
DDP and Adam, batches of 8; without the tests' copy of the whole state at every step), auditing every other
committed step (``every_n_steps=2``), so that audited and unaudited steps alternate in the same run and
share its load. ``step ms`` is the median wall time of an unaudited loop iteration (forward, backward,
torchft's all-reduce, the optimizer step), ``audited`` that of an audited one (the audit runs in the
optimizer step's pre-hook), from step 4 on, both replicas. ``added`` is the median, over audited steps, of
an audited step's time less the mean of its two unaudited neighbours' (a drift in the host's load cancels
out), and its share of the unaudited step. ``audit ms`` is the median ``duration_ms`` of the records: the
roll call in the quorum's store, which carries every replica's summary (a healthy audit sends nothing
else) and absorbs the replicas' skew (without an audit the next all-reduce waits it out instead).
``coverage`` ``1/n``: each audit reads one n-th of every large tensor (every byte in n audits in a row;
the first quorum's audit reads all).
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


def _row(name: str, shape: dict[str, int], coverage: str, steps: int) -> list[Any]:
    options = {} if coverage == "1" else {"options": {"coverage": coverage}}
    res = run_job([Replica(0), Replica(1)], steps=steps, every=2, timeout_s=30.0, deadline_s=600.0, truth=False,
                  **options, **shape)  # fmt: skip
    audited = {x["step"] for r in res.values() for x in r["records"]}
    times: dict[bool, list[float]] = {True: [], False: []}
    paired: list[float] = []
    for r in res.values():
        ms = {step: seconds * 1e3 for step, seconds in r["step_s"] if step >= 4}
        for step, t in ms.items():
            times[step in audited].append(t)
            if step in audited and step - 1 in ms and step + 1 in ms:  # against its two unaudited neighbours
                paired.append(t - (ms[step - 1] + ms[step + 1]) / 2)
    bare, with_audit, added = statistics.median(times[False]), statistics.median(times[True]), statistics.median(paired)
    audit_ms = statistics.median(x["duration_ms"] for r in res.values() for x in r["records"] if x["step"] >= 4)
    return [name, coverage, f"{bare:.1f}", f"{with_audit:.1f}", f"{added:+.1f} ({100 * added / bare:+.1f}%)",
            f"{audit_ms:.2f}", str(len(times[True]))]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--coverage", nargs="+", default=["1", "1/8", "1/16"], help="for 4 x Linear (the tiny one: 1)")
    parser.add_argument("--model", choices=["tiny", "linear"], help="only this model")
    args = parser.parse_args(argv)
    models = {n: s for n, s in MODELS.items() if args.model is None or args.model in n.lower()}
    rows = [_row(name, shape, c, args.steps) for name, shape in models.items()
            for c in (args.coverage if "square" in shape else ["1"])]  # fmt: skip
    print(machine())
    print("2 replica groups of 1 process; Adam; an audit every other committed step; medians from step 4 on")
    print(table(["model", "coverage", "step ms", "audited step ms", "added ms", "audit ms", "audited steps"], rows))


if __name__ == "__main__":
    main()
