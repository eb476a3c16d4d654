"""The one-shot GPU check script dry-runs on the CPU, so that it cannot rot before a GPU session runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_check_dry_runs_every_check_on_the_cpu_and_answers_right() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("| check") :]
    for check in (
        "resync fused Adam",
        "resync capturable Adam",
        "SyncBatchNorm",
        "digest == reference",
        "bit flips",
        "side-stream write",
        "xxh3 host memory",
        "rate 0.00839 GB",
        "rate 0.0336 GB",
    ):
        assert check in table
    assert "WRONG" not in table and "every answer right" in done.stdout
