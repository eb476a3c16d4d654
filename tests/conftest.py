import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# The benchmarks' measuring helpers (peak memory) serve the tests too.
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
os.environ.setdefault("PL_DISABLE_FORK", "0")

# DDP's constructor imports torch._dynamo lazily (about a second); importing it once here means
# every forked rank inherits it instead of paying for it again.
import torch._dynamo  # noqa: F401


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario of tests/scripts/trainers_run.py in one launch, shared by the modules that judge them.

    ``torchrun`` twice, as two one-process "nodes" rendezvousing on 127.0.0.1 (every local rank 0, global
    ranks 0 and 1); importing ``transformers`` in each rank is the slow part, paid once for the session.
    Returns ``{scenario: {rank: what the rank wrote}}`` plus ``codes`` (the launchers' exit codes) and ``log``.
    """
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from ranks import free_port

    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("trainers")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_DISABLED": "true",
        "OMP_NUM_THREADS": "1",
    }
    port = free_port()

    def launch(node: int) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node-rank={node}"]
        cmd += ["--rdzv-backend=static", f"--rdzv-endpoint=127.0.0.1:{port}"]
        cmd += [str(root / "tests" / "scripts" / "trainers_run.py"), str(out)]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    launchers = [launch(0), launch(1)]
    logs, codes = [], []
    try:
        for p in launchers:
            logs.append(p.communicate(timeout=280)[0])
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
