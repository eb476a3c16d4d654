"""A run that audited exits cleanly on every rank, whether or not it destroys the process group.

Real interpreter exits (not the forked test ranks' ``os._exit``): the audit's gloo group and digest
threads are torn down at exit before torch's own teardown, so no rank aborts ("terminate called ...").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ranks import free_port

SCRIPT = Path(__file__).parent / "scripts" / "audit_and_exit.py"


@pytest.mark.parametrize("ending", ["destroy", "keep"])
def test_plain_script_exits_0_on_every_rank_after_auditing(ending: str) -> None:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["WEIGHTSYNC_AUDIT_THREADS"] = "2"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), ending],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, (rank, p.returncode, err[-2000:])
        assert "done" in out and "terminate called" not in err, (rank, err[-2000:])
