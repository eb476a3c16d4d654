"""The exit-code contract and the restart recipe, on 2 real processes (one of them under torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "restart_run.py"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.slow
def test_a_divergence_under_raise_with_exit_code_ends_every_rank_with_that_status_after_the_record(
    tmp_path: Path,
) -> None:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path), "8"],
            env=_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [17, 17], logs
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    last = records[-1]
    assert (last["step"], last["action"], last["mismatches"][0]["ranks"]) == (6, "raised", [1])
    assert "exiting with status 17" in logs[0]
    assert not list(tmp_path.glob("end.rank*.json"))


def _launch(tmp_path: Path, restarts: int) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    """The docs' recipe: ``weightsync-audit launch -- torchrun --max-restarts=N restart_run.py`` on 2 CPU ranks."""
    evict, health = tmp_path / "evict.json", tmp_path / "health"
    cmd = [sys.executable, "-c", "import sys; from weightsync_audit.cli import main; sys.exit(main())", "launch"]
    cmd += ["--evict-file", str(evict), "--segment-health-dir", str(health), "--"]
    cmd += [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--max-restarts={restarts}"]
    cmd += ["--standalone", str(SCRIPT), str(tmp_path), "10"]
    done = subprocess.run(cmd, env=_env(SLURM_JOB_ID="4242"), capture_output=True, text=True, timeout=240)
    return done, evict, health


@pytest.mark.slow
def test_torchrun_restarts_a_run_that_exited_17_and_it_resumes_from_the_last_verified_checkpoint_in_sync(
    tmp_path: Path,
) -> None:
    done, evict, health = _launch(tmp_path, restarts=1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ends = [json.loads((tmp_path / f"end.rank{r}.json").read_text()) for r in range(2)]
    assert [e["attempt"] for e in ends] == [1, 1]
    # every rank resumed its own RNG stream, the scheduler and the data position of step 4: exact
    assert ends[0]["resumed"] == ends[1]["resumed"] == {"step": 4, "status": "matching", "resume": "exact"}
    assert ends[0]["sum"] == ends[1]["sum"]
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    raised = [r for r in records if r["action"] == "raised"]
    assert [(r["step"], r["mismatches"][0]["ranks"]) for r in raised] == [(6, [1])]
    after = records[records.index(raised[0]) + 1 :]
    assert after[0]["hook"] == "resume" and after[0]["checkpoint"]["status"] == "matching"
    assert after[0]["checkpoint"]["resume"]["findings"] == []
    assert all(r["in_sync"] for r in after) and after[-1]["step"] == 10
    # the first attempt handed rank 1's host on: the evict file and NVRx's segment health-check file
    doc = json.loads(evict.read_text())
    assert (doc["exit_code"], doc["step"], doc["attempt"], [h["rank"] for h in doc["hosts"]]) == (17, 6, 0, [1])
    assert doc["hosts"][0]["host"] == raised[0]["hosts"]["1"].split()[0]
    assert "rank 1" in (health / "segment_health_check.4242.4242").read_text()
    assert "completed after a restart" in done.stderr


@pytest.mark.slow
def test_the_launch_wrapper_exits_17_where_torchrun_itself_exits_1(tmp_path: Path) -> None:
    done, evict, _ = _launch(tmp_path, restarts=0)
    assert done.returncode == 17, done.stdout[-3000:] + done.stderr[-3000:]
    assert "exitcode  : 17" in done.stderr or "exitcode: 17" in done.stderr.replace("  ", " ")  # torchrun saw 17
    assert json.loads(evict.read_text())["hosts"][0]["rank"] == 1
    assert "exiting with status 17" in done.stderr
