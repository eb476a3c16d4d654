"""The one-shot GPU check script dry-runs on the CPU, so that it cannot rot before a GPU session runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ATTRIBUTION_ROWS = (
    "attribution: healthy",
    "attribution: bit flip at rest",
    "attribution: update off by one ulp",
    "attribution: gradient changed after the all-reduce",
    "attribution: different lr on one rank",
    "attribution: all-reduce result changed",
    "attribution cost",
)
RESUME_ROWS = ("resume: clean", "resume: rank 1 with rank 0's RNG", "resume: CUDA RNG from rank 0")


@pytest.mark.slow
def test_the_gpu_check_dry_runs_every_check_on_the_cpu_and_answersright_answer(warm_python: str) -> None:
    done = subprocess.run(
        [warm_python, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"],
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
        *ATTRIBUTION_ROWS,
        *RESUME_ROWS,
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


def _benchmarks() -> None:
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))


def _answers(rows: list[tuple[str, str, bool | None, str]]) -> dict[str, bool | None]:
    return {check: ok for check, _, ok, _ in rows}


def test_the_attribution_rows_dry_run_every_fault_namedright_answer() -> None:
    _benchmarks()
    import gpu_attribution

    rows = gpu_attribution.run(device=torch.device("cpu"), dry=True)
    answers = _answers(rows)
    assert sorted(answers) == sorted(ATTRIBUTION_ROWS), rows
    assert all(ok is True for ok in answers.values()), rows  # no WRONG, and nothing skipped on the CPU


def test_an_attribution_that_blames_the_wrong_rank_or_class_is_wrong() -> None:
    _benchmarks()
    from attribution_faults import Fault
    from campaign_attribution import score
    from gpu_attribution import right_answer

    def divergent(ranks: list[int], evidence: str, hardware: bool) -> list[dict[str, object]]:
        blame = {"ranks": ranks, "evidence": evidence, "hardware_suspect": hardware, "step": 4}
        return [{"in_sync": True}, {"in_sync": False, "blame": blame}]

    flip = Fault("flip_at_rest", rank=1)
    assert right_answer(score(flip, divergent([1], "at_rest_change", True)))
    assert not right_answer(score(flip, divergent([0], "at_rest_change", True)))  # the other rank
    assert not right_answer(score(flip, divergent([1], "update_not_reproducible", True)))  # the wrong class
    assert not right_answer(score(flip, divergent([1], "at_rest_change", False)))  # not called hardware
    assert not right_answer(score(flip, [{"in_sync": True}]))  # missed
    collective = Fault("collective_bytes", rank=1)
    assert right_answer(score(collective, divergent([], "collective_mismatch", False)))  # 2 ranks: undecided is right
    assert not right_answer(score(collective, divergent([0], "collective_mismatch", False)))
    assert not right_answer(score(Fault(None), divergent([0], "vote", False)))  # a false alarm


def test_the_resume_rows_dry_runright_answer_with_the_cuda_row_skipped_for_a_reason() -> None:
    _benchmarks()
    import gpu_resume

    rows = gpu_resume.run(device=torch.device("cpu"), dry=True)
    answers = _answers(rows)
    assert sorted(answers) == sorted(RESUME_ROWS), rows
    assert answers.pop("resume: CUDA RNG from rank 0") is None
    assert all(ok is True for ok in answers.values()), rows
    assert "no CUDA generator" in rows[-1][3]


def test_a_resume_record_that_names_the_wrong_rank_or_nothing_disagrees_with_the_truth() -> None:
    _benchmarks()
    from gpu_resume import claims, truth

    saved = [{"cpu": torch.tensor([0], dtype=torch.uint8)}, {"cpu": torch.tensor([1], dtype=torch.uint8)}]
    swapped = [saved[0], saved[0]]
    assert truth(saved, saved) == {} and truth(saved, swapped) == {(1, "rng.torch"): 0}
    right = [{"component": "rng.torch", "ranks": [1], "from_ranks": [0], "detail": "-"}]
    assert claims(right) == truth(saved, swapped)
    assert claims([{**right[0], "ranks": [0], "from_ranks": [1]}]) != truth(saved, swapped)
    assert claims([]) != truth(saved, swapped)
