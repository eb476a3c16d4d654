"""``weightsync-audit verify`` on the per-rank resume state, on one machine: the rank RNG files a resume would
load and the replicated state saved unequal (exit 0 / 1), from a checkpoint folder built here."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch

from weightsync_audit import Auditor
from weightsync_audit.cli import main
from weightsync_audit.engine.checkpoints.resume_state import digest_state, rng_file_state
from weightsync_audit.engine.checkpoints.sidecar import read_sidecar, write_sidecar


def _folder(tmp_path: Path, scheduler_steps: tuple[int, int] = (2, 2)) -> Path:
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), folder / "model.pt")
    for r in range(len(scheduler_steps)):  # every file of the checkpoint before its sidecar, as a save writes them
        torch.manual_seed(10 + r), np.random.seed(10 + r), random.seed(10 + r)
        state = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        torch.save(state, folder / f"rng_state_{r}.pth")
    Auditor(model).checkpoint_saved(folder, 2, state=model.state_dict())
    ranks = {}
    for r, steps in enumerate(scheduler_steps):
        ranks[str(r)] = rng_file_state(str(folder / f"rng_state_{r}.pth"))
        ranks[str(r)]["lr_scheduler"] = {"digest": digest_state({"last_epoch": steps}), "value": {"step": steps}}
    sidecar = read_sidecar(folder)
    assert sidecar is not None
    write_sidecar(folder, {**sidecar, "resume": {"ranks": ranks}})
    return folder


def test_verify_passes_a_folder_whose_rng_files_are_each_ranks_own(tmp_path: Path) -> None:
    assert main(["verify", str(_folder(tmp_path))]) == 0


def test_verify_names_rank_1s_rng_file_holding_rank_0s_state_and_exits_1(tmp_path: Path, capsys) -> None:
    folder = _folder(tmp_path)
    shutil.copy(folder / "rng_state_0.pth", folder / "rng_state_1.pth")
    assert main(["verify", str(folder)]) == 1
    assert "rank 1 would resume with rank 0's RNG state (torch, numpy, Python random)" in capsys.readouterr().out


def test_verify_names_an_lr_scheduler_saved_unequal_across_ranks(tmp_path: Path, capsys) -> None:
    assert main(["verify", str(_folder(tmp_path, scheduler_steps=(2, 1))), "--json"]) == 1
    assert "the lr scheduler differed across ranks when saved" in capsys.readouterr().out
