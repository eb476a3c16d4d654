"""Cost of ``check_finite=True``: counting the audited tensors that hold NaN or inf at every audit.

    python benchmarks/bench_finite.py                       # 20,011 entries (Adam) on 1 and 2 ranks, 100M on 1
    python benchmarks/bench_finite.py --cases many --worlds 1,2 --reps 9

In the same run, on the same ranks, a warmed-up ``Auditor`` without and one with ``check_finite`` are
timed in turns within each repetition (the order alternating; ``bench_many.paired``), so the load of the
moment weighs on both alike; the ratio is the median of the per-repetition ratios (wall time, slowest
rank). Without the option nothing is counted on the healthy path (diverged tensors are always counted,
off the healthy path).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_many
from harness import launch, machine, median, own_copy
from models import SPECS
from models import build as build_model

from weightsync_audit import Auditor

_CASE: tuple[str, Any, Any] | None = None


def _rank(rank: int, world: int, reps: int) -> dict[str, Any]:
    assert _CASE is not None
    label, model, opt = _CASE
    if world > 1:
        own_copy(model)
    plain, finite = Auditor(model, opt), Auditor(model, opt, check_finite=True)
    for a in (plain, finite):
        a.audit()
    assert finite.audit().nonfinite_count == 0
    wall, _ = bench_many.paired({"plain": plain.audit, "finite": finite.audit}, reps)
    return {
        "case": label,
        "world": world,
        "plain": median(wall["plain"]),
        "finite": median(wall["finite"]),
        "ratio": median([f / p for f, p in zip(wall["finite"], wall["plain"])]),
    }


def main(argv: list[str] | None = None) -> None:
    global _CASE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="many,100M", help="comma-separated: many (20,011 entries, Adam), 100M")
    p.add_argument("--worlds", default="1,2", help="worlds for 'many' (100M runs on 1 rank)")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    print(f"# {machine()}", flush=True)
    print("| case | ranks | audit ms | audit + check_finite ms | ratio |")
    print("|---|---|---|---|---|")
    for case in args.cases.split(","):
        if case == "many":
            model, opt = bench_many.build(20000, True)
            _CASE = ("20,011 entries (Adam)", model, opt)
            worlds = [int(w) for w in args.worlds.split(",")]
        else:
            _CASE = (SPECS[case].label, build_model(SPECS[case]), None)
            worlds = [1]
        for world in worlds:
            r = launch(_rank, world, args.reps)[0] if world > 1 else _rank(0, 1, args.reps)
            print(
                f"| {r['case']} | {world} | {r['plain'] * 1e3:.2f} | {r['finite'] * 1e3:.2f} | {r['ratio']:.2f}x |",
                flush=True,
            )
        _CASE = None


if __name__ == "__main__":
    main()
