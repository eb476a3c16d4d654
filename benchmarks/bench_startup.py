"""Start-up cost: what ``import weightsync_audit`` adds to ``import torch``, and how long a CLI call takes.

    python benchmarks/bench_startup.py                    # this checkout, 7 cold runs each
    python benchmarks/bench_startup.py --baseline /work/main --runs 5

Every figure is the median wall time of fresh interpreter processes (cold: nothing cached in-process).
"before" is the same checkout loading everything the package used to load at import (every public
name, and ``torch.distributed.fsdp`` which the hints once imported at module level), or, with
``--baseline DIR``, another checkout measured the same way in the same run. The figures are printed
side by side with their ratio; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What the package used to import eagerly: every public name, and the FSDP package.
EAGER = "import weightsync_audit as w; [getattr(w, n) for n in w.__all__ if n not in ('WeightSyncAudit', 'DDPRewrapOnTrainableChange')]; import torch.distributed.fsdp"


def _time(argv: list[str], root: Path, runs: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(root))  # and cwd=root: `-m`/`-c` put the cwd first on sys.path
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        code = subprocess.run(argv, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        assert code in (0, 1), f"{argv} exited {code}"
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _report(folder: str) -> str:
    """A 50-audit report written by the package's own writer (which needs no torch)."""
    sys.path.insert(0, str(ROOT))
    from weightsync_audit import AuditResult, ReportWriter

    path = os.path.join(folder, "audit.jsonl")
    with ReportWriter(path) as w:
        for step in range(1, 51):
            w.write(AuditResult(in_sync=True, step=step, epoch=0, world_size=2, action="warned"))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to time as 'before'")
    args = parser.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as d:
        report = _report(d)
        cli = [py, "-m", "weightsync_audit"]
        cases = [
            ("python -c 'import torch'", [py, "-c", "import torch"], None),
            ("import torch; import weightsync_audit", [py, "-c", "import torch, weightsync_audit"], EAGER),
            ("import torch; weightsync_audit.audit", [py, "-c", "import torch, weightsync_audit as w; w.audit"], EAGER),
            ("weightsync-audit --version", [*cli, "--version"], None),
            ("weightsync-audit check REPORT", [*cli, "check", report], None),
            ("weightsync-audit show REPORT", [*cli, "show", report], None),
        ]
        print(f"median of {args.runs} cold runs (s); before = " + (str(args.baseline) if args.baseline else "eager"))
        print(f"{'command':42} {'before':>8} {'after':>8} {'ratio':>7}")
        for label, argv, eager in cases:
            after = _time(argv, ROOT, args.runs)
            if args.baseline is not None:
                before = _time(argv, args.baseline, args.runs)
            elif eager is not None:
                before = _time([py, "-c", "import torch; " + eager], ROOT, args.runs)
            else:
                before = float("nan")
            ratio = before / after if before == before else float("nan")
            print(f"{label:42} {before:8.2f} {after:8.2f} {ratio:6.1f}x")


if __name__ == "__main__":
    main()
