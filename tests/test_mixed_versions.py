"""Ranks of one job running different releases: each says the ranks are out of step, none aborts.

The previous release's frames were a fixed 208 bytes up and 160 down with at most 128 bytes of body
inline; gloo terminates a process that receives a message longer than its receive buffer. Frames now
carry up to a kilobyte inline, flagged, and once the summaries show another protocol the channel falls
back to what the previous release reads. The previous release is taken from this repository's history
(``git archive``), so this runs the real thing on one rank against this tree on the other.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest
from ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
PREVIOUS = "44ff1dd"  # the release before frames went at their own length (stop 27)


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the previous release comes from its history")
    out = tmp_path_factory.mktemp("previous")
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS, "weightsync_audit"], capture_output=True)
    assert tar.returncode == 0, tar.stderr.decode()
    with tarfile.open(fileobj=BytesIO(tar.stdout)) as t:
        t.extractall(out, filter="data")
    return out


def _job(paths: list[Path]) -> list[str]:
    port = free_port()
    procs = []
    for rank, path in enumerate(paths):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(paths)), MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(port), PYTHONPATH=str(path))
        env.pop("WEIGHTSYNC_AUDIT", None)
        cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "mixed_version_rank.py")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            out = p.communicate(timeout=120)[0]
        finally:
            p.kill()
        assert p.returncode == 0, f"a rank ended with status {p.returncode}:\n{out[-3000:]}"
        outs.append(next((ln for ln in out.splitlines() if ln.startswith("result: ")), out[-2000:]))
    return outs


@pytest.mark.parametrize("previous_rank", [0, 1], ids=["previous-coordinator", "previous-peer"])
def test_ranks_on_two_releases_are_out_of_step_on_every_rank_and_none_aborts(
    previous_release: Path, previous_rank: int
) -> None:
    paths = [ROOT, ROOT]
    paths[previous_rank] = previous_release
    outs = _job(paths)
    assert all(o.startswith("result: AuditOutOfStepError from ") for o in outs), outs
    assert str(previous_release) in outs[previous_rank] and str(previous_release) not in outs[1 - previous_rank]
