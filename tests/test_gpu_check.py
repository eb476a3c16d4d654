"""The one-shot GPU check script dry-runs on the CPU, so that it cannot rot before a GPU session runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

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
        "overlap 2 ranks",
        "overlap step ratio",
        "Megatron hash check",
    ):
        assert check in table
    assert "WRONG" not in table and "every answer right" in done.stdout


def test_the_gpu_check_calls_wrong_digests_wrong() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    from weightsync_audit.engine.hashing import device_digest as D

    with mock.patch.object(D, "_GOLD", 1):  # device arithmetic that no longer follows the definition
        ok, figures = gpu_check.check_digests(torch.device("cpu"))
    assert not ok and "WRONG" in figures
    report = gpu_check.Report()
    report.run("digest == reference", "-", lambda: (ok, figures))
    report.run("raises", "-", lambda: 1 / 0)  # type: ignore[arg-type, return-value]
    assert report.wrong and [r[2] for r in report.rows] == ["WRONG", "WRONG"]
