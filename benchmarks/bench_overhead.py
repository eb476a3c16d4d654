"""Where the time of an audit goes, per phase, for a model of many small tensors (or any model here).

    python benchmarks/bench_overhead.py                   # 5,000 small tensors, one process
    python benchmarks/bench_overhead.py --model 100M --profile

A model of tiny tensors measures the fixed cost per tensor of the whole audit path: building the
manifest (names, kinds, shapes, dtypes), the structure digest, the value digests, and the rest of
``Auditor.audit`` (summary, verdict, result). ``--profile`` adds the top of a cProfile of the audit.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from harness import machine, table
from models import SPECS, build

from weightsync_audit import Auditor
from weightsync_audit.engine.hashing.digest import digest_entries, structure_digest
from weightsync_audit.engine.inventory.manifest import build_manifest


def median_s(fn: Callable[[], Any], reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="5000-small", choices=list(SPECS))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = build(SPECS[args.model])
    auditor = Auditor(model)
    entries = build_manifest(model).entries
    n = len(entries)
    phases = {
        "manifest (manifest.build_manifest)": lambda: build_manifest(model),
        "structure digest": lambda: structure_digest(entries),
        "value digests (digest.digest_entries)": lambda: digest_entries(entries),
        "whole audit, one rank": lambda: auditor.audit(),
    }
    times = {k: median_s(f, args.reps) for k, f in phases.items()}
    rest = times["whole audit, one rank"] - sum(v for k, v in times.items() if k != "whole audit, one rank")
    rows = [[k, f"{v * 1e3:.2f}", f"{v / n * 1e6:.2f}"] for k, v in times.items()]
    rows.insert(3, ["rest of Auditor.audit (summary, verdict, result)", f"{rest * 1e3:.2f}", f"{rest / n * 1e6:.2f}"])
    print(f"# {machine()}")
    print(f"# {SPECS[args.model].label}: {n} audited tensors; median of {args.reps}")
    print(table(["phase", "ms", "us per tensor"], rows))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            auditor.audit()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        print(out.getvalue())


if __name__ == "__main__":
    main()
