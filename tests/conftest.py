import gc
import json
import os
import sys
from typing import Any, Callable, Iterator

import pytest
from lanes import make_scheduler

sys.path.insert(0, os.path.dirname(__file__))
# The benchmarks' measuring helpers (peak memory) serve the tests too.
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
os.environ.setdefault("PL_DISABLE_FORK", "0")
# Lightning's ddp and ddp_spawn, given no MASTER_PORT, pick one by bind-then-close in the kernel's ephemeral range,
# where a concurrent test's gloo pair may take it first: Lightning's ranks then connect to that pair (CI: "Gloo
# connectFullMesh failed ... Connection closed by peer"). Its STANDALONE_PORT, a port of this process's slice
# below that range (tests/ranks.py), is its default here; docs pages get one each (tests/test_docs.py).
from ranks import free_port

os.environ["STANDALONE_PORT"] = str(free_port())
# No collector pass while collection imports torch, the Trainers, Ray and Megatron (a tenth of it, in each worker):
# what they build is kept anyway, and pytest_collection_finish collects once and freezes it.
gc.disable()

# DDP's constructor imports torch._dynamo lazily (about a second); importing it once here means
# every forked rank inherits it instead of paying for it again.
import torch._dynamo  # noqa: E402, F401

# The collector's passes over what the workers imported (torch, the Trainers, Ray: millions of objects) were a
# fifth of the suite's CPU, most of it in the forked ranks, where each pass also copies the pages it touches
# (perf record -a over `make test`). Nothing imported is garbage: it is frozen once collected
# (pytest_collection_finish), and every fork freezes what it inherits.
os.register_at_fork(after_in_child=gc.freeze)

HEAVIEST_FIRST = (
    "test_ray_train.py",
    "test_timeouts.py",
    "test_channel_tree.py",
    "test_campaign.py",
    "test_docs.py",
    "test_restart.py",
    "test_callback.py",
    "test_dataplane.py",
    "test_hostile_input.py",
    "test_channel_faults.py",
    "test_torchft.py",
    "test_activation_hf_zero_code.py",
    "test_callback_faults.py",
    "test_lifetime.py",
    "test_launch.py",
    "test_foreign_groups.py",
    "test_package.py",
    "test_lightning_20340.py",
    "test_engine_distributed.py",
    "test_gpu_check.py",
    "test_startup.py",
    "test_soak.py",
    "test_integrations.py",
    "test_replicas_trainers.py",
    "test_channel_rounds.py",
    "test_replicas_partial.py",
    "test_lightning_sharded.py",
    "test_mesh.py",
    "test_device_digest.py",
    "test_mesh_attribution.py",
    "test_first_contact.py",
)
"""The files that take longest (``pytest --durations``; seconds measured alone), longest first, those that mostly
wait (Ray's actors, deadlines: timeouts, late or dead ranks) between those that keep the cores busy, so that a
waiting worker leaves its core to the other; Ray's runs (a core and more of their own, and slower by half
beside the campaign's forked ranks) start beside the deadline tests. ``make test`` hands whole files to its
workers in collection order (``--dist loadfile --no-loadscope-reorder``): these first, then the others by their
number of tests, so that no long file starts last and holds the run's end. Files that wait on deadlines
(dataplane, channel faults, callback faults, foreign groups) sit between ones that compute, and the long files
of few tests (package, startup, soak, engine_distributed) are here too: left to the count, they ran last, one
worker alone for their length (a worker's CPU time and ``vmstat`` per test, stop 59). With ``TEST_WORKERS=3`` the
waiting files go to a lane of their own (tests/lanes.py) and the others keep this order."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return make_scheduler(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        gc.enable()  # xdist's controller collects nothing: its collector runs as usual


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()
    gc.enable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Test files in the order of :data:`HEAVIEST_FIRST`, then by their number of tests; each file's own
    order is kept (its module fixtures and tests/test_docs.py's page order rely on it)."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path.name], str(item.path)))


WARM_IMPORTS = ("transformers", "accelerate", "pytorch_lightning", "lightning.pytorch")
"""What the scripts that ``warm_python`` runs import: the Hugging Face Trainer, Lightning."""


@pytest.fixture(scope="session")
def warm_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ``python`` to start a script whose launcher and ranks are the point, not an interpreter's start.

    It runs the command as ``python`` would (argv, environment, folder, open files, exit status, signals),
    forked off one process per worker that has imported torch, the Hugging Face Trainer and Lightning
    (tests/zygote.py ``WarmPython``); the interpreters the script starts through ``sys.executable`` (torchrun's
    ranks, Lightning's launcher's) go through it too. Offline for Hugging Face, as the runs are. Never for a
    test of what a fresh interpreter imports or of a launcher's process handling.
    """
    from torchrun import OFFLINE
    from zygote import WarmPython

    warm = WarmPython(tmp_path_factory.mktemp("warm-python"), {**os.environ, **OFFLINE}, WARM_IMPORTS)
    yield warm.python
    warm.close()


@pytest.fixture
def warm_spawn(warm_python: str) -> Iterator[None]:
    """The processes multiprocessing spawns in this test (Lightning's ``ddp_spawn`` workers) start through
    ``warm_python``; each still unpickles what it is handed, as a spawned process does."""
    import multiprocessing

    multiprocessing.set_executable(warm_python)
    yield
    multiprocessing.set_executable(sys.executable)


@pytest.fixture(scope="session")
def trainer_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
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
            ROOT / "tests" / "scripts" / "trainers_run.py",
            tmp_path_factory.mktemp("trainers"),
            env=OFFLINE,
            python=request.getfixturevalue("warm_python"),
        ),
    )


DEMO_ARGS = ("demo", "--epochs", "4")
"""``weightsync-audit demo --epochs 4``: what docs/quickstart.md and docs/lightning-20340.md run and
tests/test_cli.py judges (2 ranks, the default), run once for the session by ``demo_run``."""


@pytest.fixture(scope="session")
def demo_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``weightsync-audit demo --epochs 4 --report FOLDER`` through the installed console script, once (its
    script run by ``warm_python``).

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
        python = request.getfixturevalue("warm_python")
        cmd = [python, bin_, *DEMO_ARGS, "--report", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "report": str(out)}

    return once_per_session(tmp_path_factory, "demo", make)


@pytest.fixture(scope="session")
def fsdp2_strategy_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``tests/scripts/model_parallel_run.py OUT fsdp-attribution`` once for the session: Lightning's
    ``ModelParallelStrategy`` (FSDP2 over 2 ranks, its subprocess launcher), ``attribution=True``, rank 1's lr
    doubled at step 3 under ``on_mismatch="warn"``. tests/test_mesh.py and tests/test_mesh_attribution.py
    judge it. Returns ``records`` (the JSONL report's) and ``ends``: each rank's end, then the launcher's
    ``rc`` and ``stderr``."""
    import subprocess

    def make() -> dict[str, Any]:
        from lightning_helpers import records

        out = tmp_path_factory.mktemp("fsdp2-strategy")
        script = os.path.join(os.path.dirname(__file__), "scripts", "model_parallel_run.py")
        python = request.getfixturevalue("warm_python")
        proc = subprocess.run(
            [python, script, str(out), "fsdp-attribution"], capture_output=True, text=True, timeout=240
        )
        ends = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
        return {
            "records": records(out / "audit.jsonl"),
            "ends": [*ends, {"rc": proc.returncode, "stderr": proc.stderr[-3000:]}],
        }

    return once_per_session(tmp_path_factory, "fsdp2-strategy", make)


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
