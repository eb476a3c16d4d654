"""Checkpoint verdicts checked against a truth the tests compute themselves (issue 30, items 6, 9 and 13):
a sampled audit never makes a ``verified`` sidecar by itself; a DCP checkpoint loaded on another number of
ranks is compared by what it restores; ``verify`` reads a DeepSpeed folder, honours ``partitioned`` and
never takes a digest look-alike for a missing tensor."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.ranks import free_port, run_ranks
from weightsync_audit import Auditor, LoopAudit
from weightsync_audit.cli import main
from weightsync_audit.engine.checkpoints.offline import verify_checkpoint
from weightsync_audit.engine.checkpoints.sidecar import read_sidecar

# -- item 6: a sampled audit and the sidecar ------------------------------------------------------------


def _sampled_save(rank: int, world: int, folder: str, skew: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # 256 KiB: sampled in 8 slices
    if skew and rank == 1:
        with torch.no_grad():
            model.weight.view(-1)[-1] += 1.0  # in the last slice, not the one a first audit reads
    got = [torch.empty_like(model.weight) for _ in range(world)]
    dist.all_gather(got, model.weight.detach())
    path = os.path.join(folder, "m.pt")
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    audit = LoopAudit(model, coverage="1/8", verbose=False)
    sampled = audit.audit(3)
    saved = audit.checkpoint_saved(path, step=3)
    later = audit.audit(4)
    audit.close()
    assert sampled is not None and saved is not None and later is not None
    return {
        "truth_equal": torch.equal(got[0], got[1]),
        "sampled": sampled.to_dict(),
        "saved": saved.to_dict(),
        "later": later.to_dict(),
    }


def test_a_sampled_audit_never_verifies_a_checkpoint_whose_replicas_differ(tmp_path: Path) -> None:
    out = run_ranks(_sampled_save, 2, str(tmp_path), True)
    assert out[0]["truth_equal"] is False
    assert out[0]["sampled"]["in_sync"] and out[0]["sampled"]["coverage"] == "1/8"  # the slice missed it
    for r in out:
        saved = r["saved"]
        assert not saved["in_sync"] and "coverage" not in saved  # the full pass at the checkpoint
        assert saved["checkpoint"]["status"] == "diverged"
        assert [(m["name"], m["ranks"]) for m in saved["mismatches"]] == [("weight", [1])]
    sidecar = json.loads((tmp_path / "m.pt.weightsync.json").read_text())
    assert (sidecar["verdict"], sidecar["coverage"], sidecar["diverged"]) == ("diverged", "full", ["weight"])
    assert main(["verify", str(tmp_path / "m.pt")]) == 1


def test_a_sampled_run_verifies_a_checkpoint_after_a_full_pass_and_keeps_sampling(tmp_path: Path) -> None:
    out = run_ranks(_sampled_save, 2, str(tmp_path), False)
    assert out[0]["truth_equal"] is True
    saved = out[0]["saved"]
    assert saved["in_sync"] and saved["checkpoint"]["status"] == "verified" and saved["last_full_sync_step"] == 3
    assert out[0]["later"]["coverage"] is not None  # sampling goes on after the checkpoint
    assert read_sidecar(tmp_path / "m.pt")["coverage"] == "full"  # type: ignore[index]
    assert main(["verify", str(tmp_path / "m.pt")]) == 0


class _SampledOnly:
    """An auditor that cannot run a full pass (it ignores ``full=``): what the sidecar then says."""

    def __init__(self, inner: Auditor) -> None:
        self.inner, self.module, self.history = inner, inner.module, inner.history

    @property
    def comm(self) -> Any:
        return self.inner.comm

    def audit(self, module: Any = None, optimizer: Any = None, *, full: bool = False, **kw: Any) -> Any:
        return self.inner.audit(module, optimizer, **kw)


def test_a_sidecar_from_an_audit_that_read_a_slice_says_sampled_and_verify_refuses_it(tmp_path: Path) -> None:
    from weightsync_audit.engine.checkpoints.verify import checkpoint_loaded, checkpoint_saved

    model = torch.nn.Linear(256, 256)
    path = tmp_path / "m.pt"
    torch.save(model.state_dict(), path)
    auditor = _SampledOnly(Auditor(model, coverage="1/8"))
    saved = checkpoint_saved(auditor, path, 5)  # type: ignore[arg-type]
    assert saved.checkpoint["status"] == "sampled" and read_sidecar(path)["verdict"] == "sampled"  # type: ignore[index]
    outcome = verify_checkpoint(path)
    assert outcome["status"] == "unverified" and "sampled audit (coverage 1/8)" in outcome["why"]
    assert main(["verify", str(path)]) == 1
    loaded = checkpoint_loaded(auditor, path, 5)  # type: ignore[arg-type]
    assert loaded.checkpoint["status"] == "unverified" and any("sampled audit" in n for n in loaded.notes)


# -- item 9: a DCP checkpoint resharded on load -----------------------------------------------------------


def _fsdp(world: int) -> torch.nn.Module:
    from mesh_models import fsdp_model, train

    model = fsdp_model(world)
    train(model, torch.optim.Adam(model.parameters(), lr=0.01), 2, seed=0)
    return model


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def _dcp_save(rank: int, world: int, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model = _fsdp(world)
    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=folder)
    saved = Auditor(model).checkpoint_saved(folder, 2, state=state)
    return {"status": saved.checkpoint["status"], "full": _full(model)}


def _dcp_load(rank: int, world: int, folder: str, saved_full: dict[str, torch.Tensor], plant: str | None) -> Any:
    import torch.distributed.checkpoint as dcp
    from mesh_models import fsdp_model

    model = fsdp_model(world)  # freshly initialised, then loaded
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=folder)
    model.load_state_dict(state["model"])
    if plant is not None and rank == 0:
        with torch.no_grad():
            dict(model.named_parameters())[plant].to_local().view(-1)[-1] += 1.0
    now = _full(model)
    truth = sorted(f"model.{k}" for k in saved_full if not torch.equal(now[k], saved_full[k]))
    result = Auditor(model).checkpoint_loaded(folder, 2, state={"model": model.state_dict()})
    return truth, result.to_dict()


def test_a_dcp_checkpoint_saved_on_2_ranks_and_loaded_exactly_on_1_is_matching(tmp_path: Path) -> None:
    folder = str(tmp_path / "dcp")
    saved = run_ranks(_dcp_save, 2, folder)
    assert saved[0]["status"] == "verified"
    [(truth, rec)] = run_ranks(_dcp_load, 1, folder, saved[0]["full"], None)
    assert truth == []
    assert rec["checkpoint"]["status"] == "matching" and rec["mismatches"] == [], rec
    assert "not_compared" not in rec["checkpoint"]


def test_a_dcp_checkpoint_resharded_to_1_rank_names_a_changed_tensor(tmp_path: Path) -> None:
    folder = str(tmp_path / "dcp")
    saved = run_ranks(_dcp_save, 2, folder)
    # The last element of fc2.weight was saved by rank 1: rank 0 of the 1-rank load now holds it.
    [(truth, rec)] = run_ranks(_dcp_load, 1, folder, saved[0]["full"], "fc2.weight")
    assert truth == ["model.fc2.weight"]
    assert rec["checkpoint"]["status"] == "changed"
    assert [(m["name"], m["ranks"], m["shape"]) for m in rec["mismatches"]] == [("model.fc2.weight", [0], [5, 12])]


def test_a_dcp_checkpoint_loaded_on_finer_shards_names_what_it_could_not_compare(tmp_path: Path) -> None:
    folder = str(tmp_path / "dcp")
    saved = run_ranks(_dcp_save, 1, folder)
    out = run_ranks(_dcp_load, 2, folder, saved[0]["full"], None)
    for truth, rec in out:
        assert truth == [] and rec["mismatches"] == []
        assert rec["checkpoint"]["not_compared"] == 6  # the six FSDP-sharded tensors: 1 box saved, 2 held
        assert any("were not compared (model.bn.bias, model.bn.weight, model.fc1.bias, ...)" in n for n in rec["notes"])


def test_a_dcp_checkpoint_loaded_on_the_same_ranks_still_names_the_rank_that_differs(tmp_path: Path) -> None:
    folder = str(tmp_path / "dcp")
    saved = run_ranks(_dcp_save, 2, folder)
    out = run_ranks(_dcp_load, 2, folder, saved[0]["full"], "fc1.weight")
    for truth, rec in out:
        assert truth == ["model.fc1.weight"]
        assert [(m["name"], m["ranks"]) for m in rec["mismatches"]] == [("model.fc1.weight", [0])]


# -- item 13: verify on folders -----------------------------------------------------------------------------


def test_verify_never_accepts_a_missing_tensor_for_another_with_the_same_digest(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    with torch.no_grad():
        model[0].bias.zero_()
        model[1].bias.zero_()  # the same digest as 0.bias
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "model.pt")
    Auditor(model).checkpoint_saved(folder, 1)
    assert verify_checkpoint(folder)["status"] == "verified"
    state = torch.load(folder / "model.pt", weights_only=True)
    del state["1.bias"]
    torch.save(state, folder / "model.pt")
    outcome = verify_checkpoint(folder)
    assert (outcome["status"], outcome["missing"]) == ("changed", ["1.bias"])


def test_verify_accepts_a_tied_weight_saved_once_as_the_sidecar_recorded(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    safetensors.save_model(model, str(folder / "model.safetensors"))  # saves the tied weight once
    Auditor(model).checkpoint_saved(folder, 1)
    assert read_sidecar(folder)["tied"] == {"head.weight": "emb.weight"}  # type: ignore[index]
    assert verify_checkpoint(folder)["status"] == "verified"


def _deepspeed_save(rank: int, world: int, port: int, folder: str) -> list[str]:
    from tests.test_replicas_deepspeed import _engine

    statuses = []
    for case in ("zero2", "zero3"):
        engine = _engine(rank, world, port, case)
        engine.save_checkpoint(os.path.join(folder, case), tag="step2")
        statuses.append(Auditor(engine.module).checkpoint_saved(os.path.join(folder, case), 2).checkpoint["status"])
    return statuses


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_reads_an_intact_deepspeed_checkpoint_folder_and_finds_a_change_in_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("deepspeed")
    out = run_ranks(_deepspeed_save, 2, free_port(), str(tmp_path), timeout=800)
    assert out[0] == ["verified", "verified"]
    zero2, zero3 = tmp_path / "zero2", tmp_path / "zero3"
    assert main(["verify", str(zero2)]) == 0
    assert main(["verify", str(zero3)]) == 0
    partitioned = read_sidecar(zero3)["partitioned"]  # type: ignore[index]
    # ZeRO-3 saves every parameter as a placeholder in its model file: the partitioned ones and the
    # persistent ones alike are named as not compared, never as changed.
    outcome3 = verify_checkpoint(zero3)
    assert partitioned and set(partitioned) <= set(outcome3["not_compared"]) and not outcome3["changed"]
    assert "partitioned tensor(s) not compared" in capsys.readouterr().out
    # The test's own reading of the engine's file: change one saved value and drop another tensor.
    model_file = zero2 / "step2" / "mp_rank_00_model_states.pt"
    saved = torch.load(model_file, weights_only=True)
    saved["module"]["0.bias"][0] += 1.0
    del saved["module"]["scale"]
    torch.save(saved, model_file)
    outcome = verify_checkpoint(zero2)
    assert (outcome["status"], outcome["changed"], outcome["missing"]) == ("changed", ["0.bias"], ["scale"])
    assert main(["verify", str(zero2)]) == 1


def _tp_round_trip(rank: int, world: int, folder: str) -> Any:
    """FSDP2 + TP on a (dp=2, tp=2) mesh: ``tp_col`` is ``(_StridedShard, Shard)``, not one box of the global
    tensor. Saved, loaded back on the same layout, one element planted on rank 0."""
    import torch.distributed.checkpoint as dcp
    from mesh_models import dp_tp_model

    model, _ = dp_tp_model()
    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=folder)
    Auditor(model).checkpoint_saved(folder, 1, state=state)
    dist.barrier()
    if rank == 0:
        with torch.no_grad():
            dict(model.named_parameters())["tp_col.weight"].to_local().view(-1)[0] += 1.0
    return Auditor(model).checkpoint_loaded(folder, 1, state={"model": model.state_dict()}).to_dict()


def test_a_tensor_that_is_not_one_box_is_still_compared_rank_by_rank(tmp_path: Path) -> None:
    out = run_ranks(_tp_round_trip, 4, str(tmp_path / "dcp"))
    for rec in out:
        assert rec["checkpoint"]["status"] == "changed"
        assert [(m["name"], m["ranks"]) for m in rec["mismatches"] if "sidecar" in (m["detail"] or "")] == [
            ("model.tp_col.weight", [0])
        ]
