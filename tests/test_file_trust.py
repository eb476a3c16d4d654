"""Every file this library reads, under hostile and damaged input (issue 42, items 1-4 and 14): nothing read
executes code (a payload in every kind of file, each asserted never to run), a sidecar identifies the files it
describes (a changed file fails a comparison by sidecars and ``verify``; a DCP ``.metadata`` is covered), a
malformed sidecar is refused naming the field, and the plain-loop recipe of docs/restarts.md verifies.

Files are written by the real writers (``torch.save``, ``dcp.save`` on gloo ranks, a Lightning ``Trainer``);
the truth is the test's own (the bytes read back, ``torch.equal``, ``dcp.load``)."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.payload import Payload
from tests.ranks import run_ranks
from weightsync_audit import Auditor, LoopAudit, ResumeSources
from weightsync_audit.cli import main
from weightsync_audit.engine.checkpoints.load import load_checkpoint
from weightsync_audit.engine.checkpoints.resume_state import rng_file_state
from weightsync_audit.engine.checkpoints.sidecar import read_sidecar, sidecar_path
from weightsync_audit.errors import UnsafeCheckpointError, WeightSyncWarning


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def _saved(folder: Path, name: str = "m.pt") -> tuple[Path, torch.nn.Module]:
    """A checkpoint file saved as the docs say, with its sidecar."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    path = folder / name
    torch.save({"model": model.state_dict()}, path)
    Auditor(model).checkpoint_saved(path, 5, state={"model": model.state_dict()})
    return path, model


# -- item 1: no reader runs a payload --------------------------------------------------------------------------


def _rng_folder(folder: Path) -> Path:
    """A checkpoint folder with a Hugging Face-style ``rng_state.pth`` and the resume state in its sidecar."""
    folder.mkdir(parents=True)
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), folder / "model.pt")
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    torch.save(state, folder / "rng_state.pth")
    LoopAudit(model, verbose=False).checkpoint_saved(folder, 2, resume=ResumeSources())
    return folder


def _deepspeed_folder(folder: Path) -> Path:
    """A folder in DeepSpeed's ``save_checkpoint`` layout: ``latest`` naming the tag, the model file under it."""
    (folder / "step2").mkdir(parents=True)
    model = torch.nn.Linear(3, 2)
    (folder / "latest").write_text("step2")
    torch.save({"module": model.state_dict()}, folder / "step2" / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"w": torch.ones(2)}}, folder / "step2" / "zero_pp_rank_0_optim_states.pt")
    Auditor(model).checkpoint_saved(folder, 2)
    return folder


def test_a_payload_in_any_file_verify_or_diff_read_is_refused_or_named_and_never_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "PWNED"
    evil = {"w": torch.ones(2), "x": Payload(marker)}
    cases: list[tuple[str, list[str], int, str]] = []

    # a checkpoint file (its sidecar copied along): verify and diff --full load it, and refuse
    path, _ = _saved(tmp_path / "file")
    good = tmp_path / "file" / "good.pt"
    shutil.copy(path, good)
    shutil.copy(sidecar_path(path), sidecar_path(good))
    torch.save(evil, path)
    cases += [
        ("checkpoint: verify", ["verify", str(path)], 2, "refused"),
        ("checkpoint: diff --full", ["diff", "--full", str(good), str(path)], 2, "refused"),
        # by the sidecars the file is never loaded: its bytes are not those its sidecar identifies
        ("checkpoint: diff by sidecars", ["diff", str(good), str(path)], 1, "B: m.pt ("),
    ]
    # a sidecar holding a pickle
    spath, _ = _saved(tmp_path / "sidecar")
    sidecar_path(spath).write_bytes(pickle.dumps(Payload(marker)))
    cases.append(("sidecar: verify", ["verify", str(spath)], 2, "unreadable sidecar"))
    # an RNG file a resume would load
    rng = _rng_folder(tmp_path / "rng")
    torch.save({"cpu": torch.get_rng_state(), "python": Payload(marker)}, rng / "rng_state.pth")
    cases.append(("RNG file: verify", ["verify", str(rng)], 2, "rng_state.pth: refused"))
    # DeepSpeed folders: the model file read for tensors is refused; a file never needed is named as changed
    ds = _deepspeed_folder(tmp_path / "ds")
    ds_opt = _deepspeed_folder(tmp_path / "ds_opt")
    torch.save(evil, ds / "step2" / "mp_rank_00_model_states.pt")
    torch.save(evil, ds_opt / "step2" / "zero_pp_rank_0_optim_states.pt")
    cases += [
        ("DeepSpeed model file: verify", ["verify", str(ds)], 2, "mp_rank_00_model_states.pt: refused"),
        ("DeepSpeed model file: diff", ["diff", "--full", str(ds), str(ds_opt)], 2, "refused"),
        ("DeepSpeed optimizer file: verify", ["verify", str(ds_opt)], 1, "step2/zero_pp_rank_0_optim_states.pt ("),
    ]
    # a report that is a pickle
    report = tmp_path / "audit.jsonl"
    report.write_bytes(pickle.dumps(Payload(marker)))
    cases += [
        ("report: check", ["check", str(report)], 2, "not an audit report"),
        ("report: show", ["show", str(report)], 2, "not an audit report"),
    ]
    for what, argv, code, says in cases:
        got, text = _cli(capsys, *argv)
        assert (got, says in text) == (code, True), f"{what}: exit {got}: {text}"
        assert "Traceback" not in text and not marker.exists(), what
    # the in-training readers: the RNG file a resume captures, the sidecar a load reads
    with pytest.raises(UnsafeCheckpointError, match="rng_state.pth: refused"):
        ResumeSources(rng_file=str(rng / "rng_state.pth")).capture()
    with pytest.warns(WeightSyncWarning, match="unreadable sidecar"):
        loaded = Auditor(torch.nn.Linear(3, 2)).checkpoint_loaded(spath, 5)
    assert loaded.checkpoint["status"] == "unverified" and any("unreadable sidecar" in n for n in loaded.notes)
    assert not marker.exists()


def _dcp_save(rank: int, world: int, folder: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=folder)
    Auditor(model).checkpoint_saved(folder, 2, state=state)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _dcp_load(folder: Path, like: dict[str, torch.Tensor]) -> bool:
    """The truth: whether ``dcp.load`` restores exactly what was saved (the test's own trusted bytes only)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = {"model": {k: torch.zeros_like(v) for k, v in like.items()}}
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except (Exception, CheckpointException):  # noqa: BLE001 - any failure to load is the truth we compare with
        return False
    return all(torch.equal(state["model"][k], like[k]) for k in like)


def test_a_dcp_folder_whose_metadata_is_damaged_or_a_payload_is_not_verified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "dcp"
    like = run_ranks(_dcp_save, 2, str(saved))[0]
    assert _dcp_load(saved, like) and main(["verify", str(saved)]) == 0
    sidecar = read_sidecar(saved)
    assert sidecar is not None and set(sidecar["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    marker = tmp_path / "PWNED"
    meta = (saved / ".metadata").read_bytes()
    damage = {
        "truncated": lambda f: (f / ".metadata").write_bytes(meta[: len(meta) // 2]),
        "deleted": lambda f: (f / ".metadata").unlink(),
        "one byte flipped": lambda f: (f / ".metadata").write_bytes(meta[:40] + bytes([meta[40] ^ 0x01]) + meta[41:]),
        "shard deleted": lambda f: (f / "__1_0.distcp").unlink(),
    }
    for what, harm in damage.items():
        folder = tmp_path / what.replace(" ", "_")
        shutil.copytree(saved, folder)
        harm(folder)
        assert not _dcp_load(folder, like), f"{what}: dcp.load still restores the checkpoint"  # the truth
        code, text = _cli(capsys, "verify", str(folder))
        assert code == 1 and "NOT VERIFIED" in text, f"{what}: {text}"
        name = "__1_0.distcp (rank 1)" if what == "shard deleted" else ".metadata"
        assert name in text, f"{what}: {text}"
    # a payload as .metadata: verify never unpickles it (dcp.load would), it names the file changed
    evil = tmp_path / "payload"
    shutil.copytree(saved, evil)
    (evil / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    code, text = _cli(capsys, "verify", str(evil))
    assert code == 1 and "file(s) changed since saved: .metadata" in text and not marker.exists()
    # diff reads a DCP folder as verify does: its files by their bytes (.metadata differs), never unpickled
    assert main(["diff", str(evil), str(saved)]) == 1 and not marker.exists()


# -- item 1: the RNG files the Trainers write are read with the allow-list, not unsafely -------------------------


def test_a_lightning_checkpoint_holding_the_rng_states_verifies(tmp_path: Path) -> None:
    from lightning_fabric.utilities.seed import _collect_rng_states
    from pytorch_lightning.callbacks import ModelCheckpoint

    from tests.lightning_helpers import SmallModel, fit
    from weightsync_audit import WeightSyncAudit

    class SavesRng(SmallModel):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters()

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:  # as docs/restarts.md suggests
            checkpoint["rng"] = _collect_rng_states()  # Lightning's own collector: torch, numpy, python

    audit = WeightSyncAudit(every_n_train_steps=None, hooks=(), verbose=False)
    ckpts = tmp_path / "ckpt"
    fit(tmp_path, SavesRng(), [audit, ModelCheckpoint(dirpath=str(ckpts))], strategy="auto", devices=1, max_epochs=1,
        enable_checkpointing=True)  # fmt: skip
    [ckpt] = ckpts.glob("*.ckpt")
    with pytest.raises(pickle.UnpicklingError):  # PyTorch's own allow-list alone refuses numpy's RNG state
        torch.load(ckpt, weights_only=True)
    assert main(["verify", str(ckpt)]) == 0
    state = load_checkpoint(ckpt)
    assert set(state["rng"]) >= {"torch", "numpy", "python"}
    assert isinstance(state["rng"]["numpy"][1], np.ndarray) and state["rng"]["numpy"][1].dtype == np.uint32
    assert main(["diff", "--full", str(ckpt), str(ckpt)]) == 0


def test_an_rng_file_written_by_numpy_1_reads_and_one_asking_for_more_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rng_state_0.pth"
    np.random.seed(3)
    torch.save({"numpy": np.random.get_state(), "cpu": torch.get_rng_state()}, path)
    expected = rng_file_state(str(path))
    # numpy 1 pickled its arrays under numpy.core: the same file as an older numpy writes it
    old = tmp_path / "old.pth"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(old, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("data.pkl"):
                assert b"numpy._core.multiarray" in data
                data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
            dst.writestr(item, data)
    assert rng_file_state(str(old)) == expected
    marker = tmp_path / "PWNED"
    torch.save({"numpy": np.array([Payload(marker)], dtype=object)}, path)  # an object array runs its items
    with pytest.raises(UnsafeCheckpointError, match="rng_state_0.pth: refused"):
        rng_file_state(str(path))
    assert not marker.exists()


# -- item 2: a sidecar identifies its file ----------------------------------------------------------------------


def test_a_comparison_by_sidecars_fails_when_a_file_no_longer_matches_its_sidecar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, model = _saved(tmp_path)
    copy = tmp_path / "copy.pt"
    shutil.copy(path, copy)
    shutil.copy(sidecar_path(path), sidecar_path(copy))
    code, text = _cli(capsys, "diff", str(path), str(copy))
    assert code == 0 and "IDENTICAL" in text and "by their sidecars" in text  # renamed along with its sidecar
    state = torch.load(copy, weights_only=True)
    state["model"]["bias"][0] += 1.0
    torch.save(state, copy)  # changed after saving, its sidecar copied along
    truth = not torch.equal(torch.load(copy, weights_only=True)["model"]["bias"], model.state_dict()["bias"])
    assert truth
    code, text = _cli(capsys, "diff", str(path), str(copy))
    size = copy.stat().st_size
    said = f"m.pt ({path.stat().st_size} bytes when saved, {size} now)"
    assert code == 1 and "STALE SIDECAR" in text and f"B: {said}" in text
    assert main(["diff", "--json", str(path), str(copy)]) == 1
    assert json.loads(capsys.readouterr().out)["stale"] == [f"B: {said}"]
    code, text = _cli(capsys, "verify", str(copy))
    assert code == 1 and f"file(s) changed since saved: {said}" in text
    assert "changed since saved: model.bias" in text
    assert main(["diff", "--full", str(path), str(copy)]) == 1
    # a sidecar of an earlier version (no files): unidentified, so the files themselves are compared
    for p in (path, copy):
        data = json.loads(sidecar_path(p).read_text())
        del data["files"]
        sidecar_path(p).write_text(json.dumps(data))
    code, text = _cli(capsys, "diff", str(path), str(copy))
    assert code == 1 and "unidentified; comparing the files" in text and "DIFFERENT" in text
    code, text = _cli(capsys, "verify", str(path))
    assert code == 0 and "does not identify the checkpoint's files" in text


def test_a_file_that_grew_vanished_or_appeared_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), folder / "model.pt")
    (folder / "trainer_state.json").write_text('{"global_step": 2}')
    (folder / "training_args.bin").write_bytes(pickle.dumps({"lr": 0.1}))
    Auditor(model).checkpoint_saved(folder, 2)
    assert set(read_sidecar(folder)["files"]) == {"model.pt", "trainer_state.json", "training_args.bin"}  # type: ignore[index]
    assert main(["verify", str(folder)]) == 0
    with open(folder / "training_args.bin", "ab") as f:
        f.write(b"more")
    (folder / "trainer_state.json").unlink()
    torch.save({"weight": torch.zeros(2, 3)}, folder / "pytorch_model.bin")  # a file a resume may load instead
    code, text = _cli(capsys, "verify", str(folder))
    size = (folder / "training_args.bin").stat().st_size
    assert code == 1 and f"training_args.bin ({size - 4} bytes when saved, {size} now)" in text
    assert "file(s) missing: trainer_state.json" in text
    assert "file(s) added since saved (a resume may read them): pytorch_model.bin" in text


def _folder_save(rank: int, world: int, folder: str) -> None:
    """Every rank writes its own RNG file and rank 0 the model and the trainer state, then the sidecar."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    torch.manual_seed(10 + rank), np.random.seed(10 + rank), random.seed(10 + rank)
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    torch.save(state, os.path.join(folder, f"rng_state_{rank}.pth"))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(folder, "model.pt"))
        Path(folder, "trainer_state.json").write_text('{"global_step": 2}')
    Auditor(model).checkpoint_saved(folder, 2)


def test_every_file_of_a_folder_saved_on_4_ranks_is_identified_by_its_bytes(tmp_path: Path) -> None:
    import xxhash

    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    run_ranks(_folder_save, 4, str(folder))
    truth = {
        f.name: {"bytes": f.stat().st_size, "digest": xxhash.xxh3_64(f.read_bytes()).hexdigest()}
        for f in folder.iterdir()
        if f.name != "weightsync.json"
    }
    assert len(truth) == 6 and read_sidecar(folder)["files"] == truth  # type: ignore[index]
    assert main(["verify", str(folder)]) == 0


# -- item 4: a malformed sidecar is refused, naming the field -----------------------------------------------------


@pytest.mark.parametrize(
    ("harm", "field"),
    [
        (lambda d: d["resume"]["ranks"].update({"1": "rank 1"}), 'resume.ranks["1"]'),
        (lambda d: d["resume"]["ranks"]["0"]["rng.torch"].pop("digest"), 'resume.ranks["0"].rng.torch.digest'),
        (lambda d: d["tensors"]["model.bias"].update({"shape": "2"}), "tensors['model.bias'].shape"),
        (lambda d: d["files"].update({"../../etc/passwd": d["files"]["m.pt"]}), "files"),
        (lambda d: d.update({"world_size": 0}), "world_size"),
    ],
    ids=["rank-entry-a-string", "entry-without-digest", "shape-a-string", "file-outside", "world-size-0"],
)
def test_a_malformed_sidecar_is_exit_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], harm: Any, field: str
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    path = tmp_path / "m.pt"
    torch.save({"model": model.state_dict()}, path)
    audit = LoopAudit(model, verbose=False)
    audit.checkpoint_saved(path, 3, state={"model": model.state_dict()}, resume=ResumeSources())
    data = json.loads(sidecar_path(path).read_text())
    data["resume"]["ranks"]["1"] = data["resume"]["ranks"]["0"]  # as if saved on two ranks
    harm(data)
    sidecar_path(path).write_text(json.dumps(data))
    code, text = _cli(capsys, "verify", str(path))
    assert code == 2 and field in text, text
    assert "Traceback" not in text and text.count("\n") == 1
    # the in-training reader of the same sidecar names it too (every rank alike), never a bare KeyError
    with pytest.warns(WeightSyncWarning, match="is unverified"):
        loaded = audit.checkpoint_loaded(path, 3, state={"model": model.state_dict()}, resume=ResumeSources())
    assert loaded is not None and loaded.checkpoint["resume"]["status"] == "unchecked"
    assert field in loaded.checkpoint["resume"]["why"]
    audit.close()


# -- item 14: the plain-loop recipe of docs/restarts.md verifies ------------------------------------------------


def test_the_plain_loop_recipe_verifies_and_a_change_in_its_file_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    audit = LoopAudit(model, opt, verbose=False)
    path = tmp_path / "step4.pt"
    ema = {k: v + 1 for k, v in model.state_dict().items()}  # another copy of the model in the same file
    torch.save({"ema": ema, "model": model.state_dict(), "opt": opt.state_dict()}, path)
    audit.checkpoint_saved(path, 4)  # the module's own names: weight, bias
    audit.close()
    assert set(read_sidecar(path)["tensors"]) == {"weight", "bias"}  # type: ignore[index]
    assert _cli(capsys, "verify", str(path))[0] == 0
    state = torch.load(path, weights_only=True)
    state["model"]["weight"][0, 0] += 1.0
    torch.save(state, path)
    code, text = _cli(capsys, "verify", str(path))
    assert code == 1 and "changed since saved: weight" in text  # found under "model.", never under "ema."
