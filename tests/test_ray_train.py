"""Lightning and the Hugging Face Trainer with the audit under ``ray.train.torch.TorchTrainer``: a real local Ray
cluster (started here, once for the module), 2 CPU workers, the scripts of docs/ray.md run as they are.

A Ray run costs tens of seconds (each run starts its controller, its workers and helper actors as processes of
their own, forked off conftest's ``warm_python``), so the module runs four:
Lightning healthy and diverged (``on_mismatch="raise"``), the HF Trainer healthy and diverged (``exit_code``).
"""

from __future__ import annotations

import builtins
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest

pytest.importorskip("ray.train.torch")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

import ray
import ray.train
from test_docs import blocks

from weightsync_audit import WeightDivergenceError
from weightsync_audit.integrations.ray_train import REPORT_NAME, ray_report_path, report_path_in
from weightsync_audit.reporting.jsonl import read_report

pytestmark = pytest.mark.slow  # four Ray Train runs: about 4 to 7 minutes on 2 shared cores
ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "ray.md"


def _script(name: str, folder: Path) -> ModuleType:
    """The page's ``<!-- file: name -->`` block, imported as a module and sent to the workers by value."""
    [code] = [b.code for b in blocks(PAGE) if b.file == name]
    path = folder / name
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(f"ray_docs_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    return module


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, warm_python: str) -> Iterator[dict[str, Any]]:
    t0 = time.perf_counter()
    kept_print = builtins.print  # Ray's progress bars replace the driver's print and never put it back
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    # No spot-preemption watcher (one more actor process a run, for a cloud's notices a local cluster never
    # gets). The controller's poll keeps its default (2 s): polled every 0.5 s, it saw one worker's verdict and
    # stopped the other before it raised its own (a fresh clone's CI, stop 56).
    env = {"PYTHONPATH": path, "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
    # Ray's worker processes start through conftest's warm_python: each has torch and the Trainers imported.
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env, "py_executable": warm_python})
    folder = tmp_path_factory.mktemp("ray")
    try:
        yield {
            "storage": str(folder / "results"),
            "lightning": _script("ray_lightning.py", folder),
            "hf": _script("ray_hf.py", folder),
            "started_s": time.perf_counter() - t0,
        }
    finally:
        ray.shutdown()
        builtins.print = kept_print  # the tests that run after these in this process see the real one


def _records(result_path: str) -> list[Any]:
    contents = read_report(Path(result_path) / REPORT_NAME)
    assert contents.errors == []
    return [r for _, r in contents.records]


def test_lightning_healthy_every_worker_in_sync_and_the_report_in_the_runs_folder(cluster: dict[str, Any]) -> None:
    result = cluster["lightning"].main(cluster["storage"], diverge=False)
    [shown] = [b.code for b in blocks(PAGE) if b.lang == "text" and "in sync throughout" in b.code]
    assert result.return_value == shown.splitlines()  # both workers, as the page shows them
    assert Path(result.path) == Path(cluster["storage"]) / "healthy"
    records = _records(result.path)
    assert [r.step for r in records if r.hook == "on_train_batch_end"] == [2, 4, 6]
    assert all(r.in_sync and r.world_size == 2 for r in records)


def test_lightning_planted_divergence_raises_on_every_worker_as_rays_training_failure(cluster: dict[str, Any]) -> None:
    with pytest.raises(ray.train.TrainingFailedError) as caught:
        cluster["lightning"].main(cluster["storage"], diverge=True)
    failures = caught.value.worker_failures  # type: ignore[attr-defined]
    assert sorted(failures) == [0, 1]  # the verdict on every worker
    for error in failures.values():
        assert isinstance(error, WeightDivergenceError), repr(error)
        assert error.result.step == 4 and error.result.diverged_names == ["net.0.weight"]
    records = _records(str(Path(cluster["storage"]) / "diverged"))
    last = records[-1]
    assert (last.in_sync, last.action, last.step) == (False, "raised", 4)
    assert last.mismatches[0].ranks == [1] and records[-2].in_sync  # in sync at step 2, apart at 4


def test_hf_trainer_healthy_every_worker_in_sync_and_the_report_in_the_runs_folder(cluster: dict[str, Any]) -> None:
    result = cluster["hf"].main(cluster["storage"], diverge=False)
    assert len(result.return_value) == 2 and len(set(result.return_value)) == 1
    assert "replicas in sync throughout" in result.return_value[0]
    records = _records(result.path)
    assert [r.step for r in records if r.hook == "on_step_end"] == [2, 4, 6]
    assert all(r.in_sync and r.world_size == 2 for r in records)


def test_hf_trainer_divergence_with_exit_code_ends_both_workers_and_ray_reports_the_failure(
    cluster: dict[str, Any],
) -> None:
    with pytest.raises(ray.train.TrainingFailedError) as caught:
        cluster["hf"].main(cluster["storage"], diverge=True, exit_code=17)
    failures = caught.value.worker_failures  # type: ignore[attr-defined]
    assert sorted(failures) == [0, 1], failures  # both worker processes ended (with status 17): Ray saw them die
    assert not any(isinstance(e, WeightDivergenceError) for e in failures.values())  # why is in the report only
    records = _records(str(Path(cluster["storage"]) / "hf-diverged"))
    last = records[-1]
    assert (last.in_sync, last.action, last.step) == (False, "raised", 4)
    assert last.mismatches[0].ranks == [1]


def test_ray_report_path_outside_a_ray_train_worker_says_where_to_call_it() -> None:
    with pytest.raises(RuntimeError, match="training function that ray.train.torch.TorchTrainer runs"):
        ray_report_path()
    with pytest.raises(ValueError, match="filename='a/b.jsonl'"):
        ray_report_path("a/b.jsonl")


def test_report_path_in_a_runs_storage_is_its_folder_and_other_file_systems_are_refused(tmp_path: Path) -> None:
    import pyarrow.fs

    storage_module = pytest.importorskip("ray.train.v2._internal.execution.storage")
    local = storage_module.StorageContext(str(tmp_path), "run")
    assert report_path_in(local) == str(tmp_path / "run" / REPORT_NAME)
    assert (tmp_path / "run").is_dir()
    other = pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem())
    with pytest.raises(ValueError, match="'subtree' file system .* give report_path= a local file"):
        report_path_in(storage_module.StorageContext("bucket", "run", storage_filesystem=other))


def test_module_time(cluster: dict[str, Any]) -> None:
    print(json.dumps({"ray_started_s": round(cluster["started_s"], 1)}))
