import os
import sys
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
    from torchrun import OFFLINE, ROOT, two_node_job

    out = tmp_path_factory.mktemp("trainers")
    return two_node_job(ROOT / "tests" / "scripts" / "trainers_run.py", out, env=OFFLINE)
