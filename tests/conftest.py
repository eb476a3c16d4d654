import json
import os
import sys
from typing import Any, Callable

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

    return once_per_session(
        tmp_path_factory,
        "trainers",
        lambda: two_node_job(
            ROOT / "tests" / "scripts" / "trainers_run.py", tmp_path_factory.mktemp("trainers"), env=OFFLINE
        ),
    )


DEMO_ARGS = ("demo", "--epochs", "4")
"""``weightsync-audit demo --epochs 4``: what docs/quickstart.md and docs/lightning-20340.md run and
tests/test_cli.py judges (2 ranks, the default), run once for the session by ``demo_run``."""


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``weightsync-audit demo --epochs 4 --report FOLDER`` through the installed console script, once.

    Off a terminal (no ``COLUMNS``/``LINES``); ``--report`` only says where the two reports go, so the
    pages that run ``weightsync-audit demo --epochs 4`` check their sample output against this run's
    (tests/test_docs.py) and tests/test_cli.py reads its reports. Returns ``returncode``, ``stdout``,
    ``stderr`` and ``report`` (the folder).
    """
    import subprocess

    def make() -> dict[str, Any]:
        out = tmp_path_factory.mktemp("demo")
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        bin_ = os.path.join(os.path.dirname(sys.executable), "weightsync-audit")
        proc = subprocess.run(
            [bin_, *DEMO_ARGS, "--report", str(out)], capture_output=True, text=True, timeout=120, env=env
        )
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "report": str(out)}

    return once_per_session(tmp_path_factory, "demo", make)


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[], Any]) -> Any:
    """``make()`` once per test session, also when pytest-xdist splits the session over workers.

    Under xdist every worker has its own session; the workers share the parent of their temporary folders,
    so the first to get there runs ``make`` under a file lock and leaves its JSON result, and the others
    read it. Without xdist, ``make()`` is simply called.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make()
    from filelock import FileLock

    path = tmp_path_factory.getbasetemp().parent / f"{name}.json"
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return _rank_keys(json.loads(path.read_text()))
        value = make()
        path.write_text(json.dumps(value))
        return value


def _rank_keys(value: Any) -> Any:
    """JSON turns the ranks' integer keys (``{scenario: {rank: ...}}``) into strings: back to integers."""
    if not isinstance(value, dict):
        return value
    return {
        k: {int(r) if r.isdigit() else r: x for r, x in v.items()} if isinstance(v, dict) else v
        for k, v in value.items()
    }
