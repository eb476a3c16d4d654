"""A job of two one-process "nodes" under ``torchrun``, as the Trainer and sharded-strategy tests launch it.

``torchrun`` twice, rendezvousing on 127.0.0.1 (every local rank 0, global ranks 0 and 1): the script
writes one ``<scenario>.rank<r>.json`` per scenario and rank into ``out``, which come back as
``{scenario: {rank: what the rank wrote}}`` with ``codes`` (the launchers' exit codes) and ``log``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from ranks import free_port

ROOT = Path(__file__).resolve().parents[1]

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true"}
"""What a Hugging Face run needs to never reach the network."""


def two_node_job(
    script: Path,
    out: Path,
    *args: str,
    paths: Sequence[Path] = (),
    env: dict[str, str] | None = None,
    timeout: float = 280,
    python: str = sys.executable,
) -> dict[str, Any]:
    """Run ``script out *args`` on two torchrun "nodes"; ``paths`` go first on ``PYTHONPATH`` (after ROOT).
    ``python``: the interpreter of the launchers and their ranks (tests/conftest.py ``warm_python``)."""
    full = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, paths), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    port = free_port()
    launchers = []
    for node in (0, 1):
        cmd = [python, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node-rank={node}"]
        cmd += ["--rdzv-backend=static", f"--rdzv-endpoint=127.0.0.1:{port}", str(script), str(out), *args]
        launchers.append(subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs, codes = [], []
    try:
        for p in launchers:
            logs.append(p.communicate(timeout=timeout)[0])
            codes.append(p.returncode)
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
    results: dict[str, Any] = {"codes": codes, "log": "\n".join(logs)[-6000:]}
    for f in out.glob("*.rank*.json"):
        scenario, rank = f.name.removesuffix(".json").split(".rank")
        results.setdefault(scenario, {})[int(rank)] = json.loads(f.read_text())
    return results
