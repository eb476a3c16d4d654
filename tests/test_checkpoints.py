"""Verified checkpoints on real gloo ranks: a sidecar written at save, checked at load before the first step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.ranks import run_ranks
from weightsync_audit import Auditor
from weightsync_audit.engine.checkpoints.sidecar import read_sidecar, sidecar_path
from weightsync_audit.reporting.record import AuditResult


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


def _save(rank: int, world: int, folder: str, skew: bool) -> dict:
    model = _model()
    if skew and rank == 1:
        with torch.no_grad():
            model[0].weight.add_(1.0)
    path = os.path.join(folder, "step5.pt")
    if rank == 0:
        torch.save(model.state_dict(), path)
    result = Auditor(model).checkpoint_saved(path, step=5)
    return result.to_dict()


def test_a_checkpoint_saved_by_a_healthy_run_is_verified(tmp_path: Path) -> None:
    records = run_ranks(_save, 2, str(tmp_path), False)
    assert records[0] == {**records[1], "time": records[0]["time"], "duration_ms": records[0]["duration_ms"]}
    assert records[0]["checkpoint"]["status"] == "verified"
    sidecar = read_sidecar(tmp_path / "step5.pt")
    assert sidecar is not None and sidecar["verdict"] == "verified" and sidecar["world_size"] == 2
    assert sidecar["step"] == 5 and set(sidecar["tensors"]) >= {"0.weight", "1.running_mean"}
    AuditResult.from_dict(records[0])  # the record validates


def test_a_checkpoint_saved_while_a_replica_differed_is_not_verified(tmp_path: Path) -> None:
    records = run_ranks(_save, 2, str(tmp_path), True)
    assert records[0]["checkpoint"]["status"] == "diverged"
    sidecar = read_sidecar(tmp_path / "step5.pt")
    assert sidecar is not None and sidecar["verdict"] == "diverged" and sidecar["diverged"] == ["0.weight"]


def _resume(rank: int, world: int, path: str, load_on: tuple[int, ...]) -> dict:
    torch.manual_seed(123)  # a fresh model that differs from the saved one until loaded
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    if rank in load_on:
        model.load_state_dict(torch.load(path, weights_only=True))
    else:
        torch.manual_seed(0)
        model.load_state_dict(_model().state_dict())  # what rank 0 saved: the same as the checkpoint
    return Auditor(model).checkpoint_loaded(path, step=5).to_dict()


def test_resuming_from_a_file_changed_after_saving_names_the_tensors_on_every_rank(tmp_path: Path) -> None:
    run_ranks(_save, 2, str(tmp_path), False)
    path = tmp_path / "step5.pt"
    state = torch.load(path, weights_only=True)
    state["1.running_var"][0] = 7.0  # changed after the sidecar was written
    torch.save(state, path)
    records = run_ranks(_resume, 2, str(path), (0, 1))
    assert records[0]["mismatches"] == records[1]["mismatches"]
    [m] = records[0]["mismatches"]
    assert (m["name"], m["kind"], m["ranks"], m["reference_ranks"]) == ("1.running_var", "buffer", [0, 1], [])
    assert "saved at step 5" in m["detail"] and not records[0]["in_sync"]
    assert records[0]["checkpoint"] == {"path": str(path), "event": "loaded", "status": "changed", "saved_step": 5}


def _resume_rank0_only(rank: int, world: int, path: str) -> dict:
    model = _model()
    with torch.no_grad():
        model[0].bias.mul_(0.5)  # trained on a bit since the save
    if rank == 0:
        model.load_state_dict(torch.load(path, weights_only=True))
    return Auditor(model).checkpoint_loaded(path, step=5).to_dict()


def test_a_checkpoint_loaded_on_rank_0_only_names_the_rank_that_holds_something_else(tmp_path: Path) -> None:
    run_ranks(_save, 2, str(tmp_path), False)
    records = run_ranks(_resume_rank0_only, 2, str(tmp_path / "step5.pt"))
    names = {(m["name"], tuple(m["ranks"]), tuple(m["reference_ranks"])) for m in records[1]["mismatches"]}
    # The replicas differ from each other, and rank 1 differs from what was saved.
    assert ("0.bias", (1,), (0,)) in names
    assert any("saved at step 5" in (m["detail"] or "") for m in records[1]["mismatches"] if m["ranks"] == [1])
    assert records[0]["checkpoint"]["status"] == "changed"


def test_a_checkpoint_without_a_sidecar_is_unverified_and_warned_once(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    path = tmp_path / "plain.pt"
    torch.save(model.state_dict(), path)
    auditor = Auditor(model)
    with pytest.warns(UserWarning, match="unverified"):
        first = auditor.checkpoint_loaded(path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = auditor.checkpoint_loaded(path)
    assert first.checkpoint["status"] == second.checkpoint["status"] == "unverified"
    assert first.in_sync and any("unverified" in n for n in first.notes)


def test_the_sidecar_sits_beside_a_file_and_inside_a_folder(tmp_path: Path) -> None:
    assert sidecar_path(tmp_path / "a.ckpt") == tmp_path / "a.ckpt.weightsync.json"
    assert sidecar_path(tmp_path) == tmp_path / "weightsync.json"
    model = torch.nn.Linear(2, 2)
    torch.save({"model": model.state_dict()}, tmp_path / "a.ckpt")
    Auditor(model).checkpoint_saved(tmp_path / "a.ckpt", 3, state={"model": model.state_dict()})
    data = json.loads((tmp_path / "a.ckpt.weightsync.json").read_text())
    assert data["schema"] == "weightsync-checkpoint/1" and set(data["tensors"]) == {"model.weight", "model.bias"}


def _dcp(rank: int, world: int, folder: str, corrupt: bool) -> dict:
    import torch.distributed.checkpoint as dcp

    model = _model()
    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=folder)
    saved = Auditor(model).checkpoint_saved(folder, 2, state=state).to_dict()
    torch.distributed.barrier()
    if corrupt and rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] = 9.0
    loaded = Auditor(model).checkpoint_loaded(folder, 2, state={"model": model.state_dict()}).to_dict()
    return {"saved": saved, "loaded": loaded}


def test_a_distributed_checkpoint_folder_records_each_shard_with_its_owner(tmp_path: Path) -> None:
    out = run_ranks(_dcp, 2, str(tmp_path / "dcp"), True)
    sidecar = read_sidecar(tmp_path / "dcp")
    assert sidecar is not None and sidecar["verdict"] == "verified"
    assert {s["rank"] for s in sidecar["shards"].values()} == {0, 1}
    assert set(sidecar["rank_tensors"]) == {"0", "1"}
    [m] = [m for m in out[0]["loaded"]["mismatches"] if "sidecar" in (m["detail"] or "")]
    assert (m["name"], m["ranks"], m["reference_ranks"]) == ("0.weight", [1], [0])  # the audit's own, one per tensor


def test_verify_exits_0_on_a_verified_checkpoint_1_when_changed_or_unverified_2_when_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from weightsync_audit.cli import main

    model = torch.nn.Linear(3, 2)
    path = tmp_path / "m.pt"
    torch.save({"state_dict": model.state_dict(), "epoch": 1}, path)
    Auditor(model).checkpoint_saved(path, 7, state={"state_dict": model.state_dict(), "epoch": 1})
    assert main(["verify", str(path)]) == 0
    assert "VERIFIED" in capsys.readouterr().out
    copy = tmp_path / "copy.pt"
    copy.write_bytes(path.read_bytes())
    (tmp_path / "copy.pt.weightsync.json").write_text(sidecar_path(path).read_text())
    assert main(["diff", str(path), str(copy)]) == 0 and "by their sidecars" in capsys.readouterr().out
    state = torch.load(path, weights_only=True)
    state["state_dict"]["bias"][1] += 1
    torch.save(state, path)
    assert main(["verify", str(path)]) == 1
    assert "changed since saved: state_dict.bias" in capsys.readouterr().out
    assert main(["diff", str(path), str(copy)]) == 1  # the sidecars agree, but m.pt is no longer the file saved
    assert "A: m.pt (same size, other bytes)" in capsys.readouterr().out
    assert main(["diff", "--full", str(path), str(copy)]) == 1
    capsys.readouterr()
    sidecar_path(path).unlink()
    assert main(["verify", str(path)]) == 1 and "UNVERIFIED" in capsys.readouterr().out
    sidecar_path(copy).write_text("{not json")
    assert main(["verify", str(copy)]) == 2
    assert main(["verify", str(tmp_path / "nothing.pt")]) == 2


def test_verify_names_a_changed_shard_of_a_distributed_checkpoint_with_its_owner(tmp_path: Path) -> None:
    from weightsync_audit.engine.checkpoints.offline import verify_checkpoint

    folder = tmp_path / "dcp"
    run_ranks(_dcp, 2, str(folder), False)
    assert verify_checkpoint(folder)["status"] == "verified"
    shard = folder / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    outcome = verify_checkpoint(folder)
    assert outcome["status"] == "changed" and outcome["changed"] == ["__1_0.distcp (rank 1)"]
