"""Resume fidelity through the Hugging Face Trainer on 2 ranks (tests/scripts/hf_resume_run.py, one scenario
of the shared trainers_run launch): each resume's record against the fault planted in its checkpoint copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def hf(trainer_runs: dict[str, Any]) -> dict[str, Any]:
    got = trainer_runs.get("hf_resume", {}).get(0)
    assert got is not None and "error" not in got, (got or {}).get("traceback") or trainer_runs["log"][-3000:]
    return got


def _details(entry: dict[str, Any]) -> list[str]:
    return [f["detail"] for f in entry["checkpoint"]["resume"]["findings"]]


def test_the_trainer_sidecar_holds_each_ranks_rng_scheduler_and_position(hf: dict[str, Any]) -> None:
    ranks = hf["sidecar_resume"]["ranks"]
    assert ranks["0"]["rng.torch"] != ranks["1"]["rng.torch"]
    assert ranks["0"]["lr_scheduler"] == ranks["1"]["lr_scheduler"]
    assert ranks["0"]["data.position"]["value"] == {"step": 2, "epoch": 0.5}


def test_a_clean_trainer_resume_is_exact(hf: dict[str, Any]) -> None:
    clean = hf["clean"]
    assert clean["hook"] == "on_train_begin" and clean["checkpoint"]["status"] == "matching"
    assert (clean["checkpoint"]["resume"]["status"], _details(clean)) == ("exact", [])


def test_rank_1s_rng_file_replaced_by_rank_0s_is_named(hf: dict[str, Any]) -> None:
    entry = hf["rng_from_rank0"]
    assert entry["checkpoint"]["resume"]["status"] == "differs"
    assert _details(entry) == ["rank 1 resumed with rank 0's RNG state (torch, numpy, Python random)"]


def test_ignore_data_skip_restarts_the_epochs_data_on_every_rank(hf: dict[str, Any]) -> None:
    assert _details(hf["ignore_data_skip"]) == [
        "the data position restarted at epoch 0 (saved at epoch 0.5) on every rank"
    ]


def test_a_checkpoint_without_scheduler_pt_restarts_the_lr_scheduler(hf: dict[str, Any]) -> None:
    assert "the lr scheduler restarted at step 0 (saved at step 2) on every rank" in _details(hf["no_scheduler"])


def test_verify_reports_the_per_rank_resume_checks_of_the_trainer_folders(hf: dict[str, Any], capsys: Any) -> None:
    from weightsync_audit.cli import main

    codes = {f: main(["verify", hf[f]["folder"]]) for f in ("clean", "rng_from_rank0", "no_scheduler")}
    said = capsys.readouterr().out
    assert codes == {"clean": 0, "rng_from_rank0": 1, "no_scheduler": 1}
    assert "rank 1 would resume with rank 0's RNG state (torch, numpy, Python random)" in said
    assert "scheduler.pt is missing: the lr scheduler would restart at step 0" in said


def test_the_trainers_rng_files_are_read_weights_only_and_a_payload_in_one_is_refused(
    hf: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    """Issue 42, item 1, on the files the Trainer wrote on 2 ranks: read with the numpy allow-list (PyTorch's own
    list refuses them), each holding what its rank saved; a payload in one is refused, never run."""
    import pickle
    import shutil

    import torch

    from tests.payload import Payload
    from weightsync_audit.cli import main
    from weightsync_audit.engine.checkpoints.resume_state import rng_file_state

    clean = Path(hf["clean"]["folder"])
    saved = hf["sidecar_resume"]["ranks"]
    for r in ("0", "1"):
        with pytest.raises(pickle.UnpicklingError):
            torch.load(clean / f"rng_state_{r}.pth", weights_only=True)
        now = rng_file_state(str(clean / f"rng_state_{r}.pth"))
        assert {c: e["digest"] for c, e in now.items()} == {c: saved[r][c]["digest"] for c in now}
    copy = tmp_path / "checkpoint-2"
    shutil.copytree(clean, copy)
    marker = tmp_path / "PWNED"
    torch.save({"cpu": torch.get_rng_state(), "python": Payload(marker)}, copy / "rng_state_1.pth")
    assert main(["verify", str(copy)]) == 2
    assert "rng_state_1.pth: refused" in capsys.readouterr().err and not marker.exists()


@pytest.fixture(scope="module")
def ranks(trainer_runs: dict[str, Any]) -> dict[int, dict[str, Any]]:
    got = trainer_runs.get("hf_resume", {})
    assert sorted(got) == [0, 1] and all("error" not in g for g in got.values()), trainer_runs["log"][-3000:]
    return got


def _draws(seen: list[list[float]]) -> list[float]:
    return [d for _, d in seen]


def test_an_end_of_epoch_checkpoint_resumed_with_ignore_data_skip_is_exact(ranks: dict[int, Any]) -> None:
    # the truth: every rank trains the uninterrupted run's batches of epoch 1 with its draws (steps 5-8)
    for r in (0, 1):
        assert ranks[r]["epoch_ignore_skip"]["seen"] == ranks[r]["epochs_full"][4:]
    record = ranks[0]["epoch_ignore_skip"]
    assert record["checkpoint"]["status"] == "matching"
    assert (record["checkpoint"]["resume"]["status"], _details(record)) == ("exact", [])


def test_a_folder_outside_output_dir_is_the_one_checked_and_its_swapped_rng_file_is_named(
    ranks: dict[int, Any],
) -> None:
    full = {r: _draws(ranks[r]["epochs_full"][4:]) for r in (0, 1)}
    resumed = {r: _draws(ranks[r]["outside_swapped"]["seen"]) for r in (0, 1)}
    # the truth: rank 1 draws what rank 0 drew uninterrupted, rank 0 its own
    assert resumed == {0: full[0], 1: full[0]} and full[0] != full[1]
    record = ranks[0]["outside_swapped"]
    assert record["checkpoint"]["path"].endswith("end-of-epoch-0") and record["checkpoint"]["status"] == "matching"
    assert record["checkpoint"]["resume"]["status"] == "differs"
    assert _details(record) == ["rank 1 resumed with rank 0's RNG state (torch, numpy, Python random)"]
