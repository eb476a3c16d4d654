"""The one folder reader (issue 50): ``diff`` and ``verify`` read every Trainer's layout by the same rule and
agree on identical, changed and truncated files; no path leaving the folder is read; ``check`` fails on a
resume that differs.

Each layout is written by the real thing where it is cheap (a Hugging Face ``Trainer``'s ``checkpoint-N``, a
Lightning ``Trainer``'s ``.ckpt``, ``torch.distributed.checkpoint``, Accelerate's ``save_state``); DeepSpeed's
``save_checkpoint`` layout (``latest`` and its tag folder) is written by hand, as tests/test_file_trust.py does.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from weightsync_audit import Auditor, LoopAudit, ResumeSources
from weightsync_audit.cli import main
from weightsync_audit.engine.checkpoints.folder import folder_units
from weightsync_audit.reporting.jsonl import ReportWriter


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    got = capsys.readouterr()
    return code, got.out + got.err


def _bump_safetensors(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(path), metadata={"format": "pt"})


def _bump_torch(path: Path) -> None:
    obj = torch.load(path, weights_only=False)  # the test's own file
    sd = obj["state_dict"] if "state_dict" in obj else obj["module"]
    name = sorted(sd)[0]
    sd[name] = sd[name] + 1
    torch.save(obj, path)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _hf(tmp: Path) -> tuple[Path, str, Callable[[Path], None]]:
    pytest.importorskip("transformers")
    from hf_setup import go_offline, tiny_trainer

    go_offline()
    from weightsync_audit.transformers import WeightSyncAuditCallback

    out = tmp / "hf"
    cb = WeightSyncAuditCallback(every_n_steps=None, verbose=False)
    trainer = tiny_trainer(out, [cb], rows=8, model_seed=0, max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    folder = out / "checkpoint-2"
    assert (folder / "training_args.bin").is_file() and (folder / "model.safetensors").is_file()
    return folder, "model.safetensors", _bump_safetensors


def _lightning(tmp: Path) -> tuple[Path, str, Callable[[Path], None]]:
    from lightning_helpers import SmallModel, fit
    from pytorch_lightning.callbacks import ModelCheckpoint

    from weightsync_audit import WeightSyncAudit

    ckpts = tmp / "pl"
    (tmp / "pl_run").mkdir()
    callbacks = [WeightSyncAudit(every_n_train_steps=None, hooks=()), ModelCheckpoint(dirpath=str(ckpts))]
    fit(tmp / "pl_run", SmallModel(), callbacks, strategy="auto", devices=1, max_epochs=1, enable_checkpointing=True)
    [ckpt] = sorted(ckpts.glob("*.ckpt"))
    return ckpt, "", _bump_torch


def _dcp(tmp: Path) -> tuple[Path, str, Callable[[Path], None]]:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    folder = tmp / "dcp"
    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    Auditor(model).checkpoint_saved(folder, 2, state=state)
    return folder, "__0_0.distcp", _flip_byte


def _accelerate(tmp: Path) -> tuple[Path, str, Callable[[Path], None]]:
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    folder = tmp / "acc"
    acc.save_state(str(folder))
    Auditor(model).checkpoint_saved(folder, 1)
    return folder, "model.safetensors", _bump_safetensors


def _deepspeed(tmp: Path) -> tuple[Path, str, Callable[[Path], None]]:
    folder = tmp / "ds"
    (folder / "global_step2").mkdir(parents=True)
    (folder / "latest").write_text("global_step2")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    torch.save({"module": model.state_dict()}, folder / "global_step2" / "mp_rank_00_model_states.pt")
    Auditor(model).checkpoint_saved(folder, 2)
    return folder, "global_step2/mp_rank_00_model_states.pt", _bump_torch


LAYOUTS = {"hf": _hf, "lightning": _lightning, "dcp": _dcp, "accelerate": _accelerate, "deepspeed": _deepspeed}


def _copy(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst)
        return dst
    dst.mkdir()
    shutil.copy(src, dst / src.name)
    shutil.copy(src.with_name(src.name + ".weightsync.json"), dst / (src.name + ".weightsync.json"))
    return dst / src.name


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_diff_and_verify_agree_on_identical_changed_and_truncated_files(
    layout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    orig, weights, change = LAYOUTS[layout](tmp_path)
    assert _cli(capsys, "verify", str(orig))[0] == 0
    for case, harm, code in (("identical", None, 0), ("changed", change, 1), ("truncated", _truncate, 1)):
        copy = _copy(orig, tmp_path / case)
        if harm is not None:
            harm(copy / weights if weights else copy)
        got, text = _cli(capsys, "verify", str(copy))
        assert got == code, f"{layout} {case}: verify: {text}"
        if case == "truncated":
            assert "bytes when saved" in text and "unreadable" not in text, text
        for argv in (["diff", "--full"], ["diff"]):  # by the files, and by the sidecars
            got, text = _cli(capsys, *argv, str(orig), str(copy))
            assert got == code, f"{layout} {case}: {' '.join(argv)}: {text}"


def test_a_safetensors_folder_that_differs_is_never_identical_and_training_args_is_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    for name, value in (("a", 1.0), ("b", 1.5)):
        (tmp_path / name).mkdir()
        save_file({"w": torch.full((4,), value)}, str(tmp_path / name / "model.safetensors"))
        # what the HF Trainer saves: a pickle of its arguments, which needs code to load
        (tmp_path / name / "training_args.bin").write_bytes(b"\x80\x04cbuiltins\nprint\n.")
        (tmp_path / name / "trainer_state.json").write_text(json.dumps({"log_history": [name]}))
    for extra in ([], ["--full"], ["--atol", "0.1"]):
        code, text = _cli(capsys, "diff", *extra, str(tmp_path / "a"), str(tmp_path / "b"))
        assert code == 1 and "DIFFERENT" in text and "model.safetensors: all" not in text, text
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    code, text = _cli(capsys, "diff", "--atol", "1", a, b)  # the weights within atol; the metadata differs
    assert code == 1 and "trainer_state.json   bytes" in text, text
    assert _cli(capsys, "diff", "--atol", "1", "--exclude", "trainer_state.json", a, b)[0] == 0
    kinds = {u.name: u.kind for u in folder_units(tmp_path / "a")}
    assert kinds == {"model.safetensors": "tensors", "trainer_state.json": "bytes", "training_args.bin": "bytes"}


def test_sharded_safetensors_are_one_unit_by_their_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    w = {"a": torch.ones(3), "b": torch.zeros(2)}
    save_file(w, str(tmp_path / "one" / "model.safetensors"))
    save_file({"a": w["a"]}, str(tmp_path / "two" / "model-00001-of-00002.safetensors"))
    save_file({"b": w["b"]}, str(tmp_path / "two" / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (tmp_path / "two" / "model.safetensors.index.json").write_text(json.dumps(index))
    [unit] = folder_units(tmp_path / "two")
    assert (unit.name, unit.kind, len(unit.files)) == ("model.safetensors", "tensors", 2)
    assert _cli(capsys, "diff", str(tmp_path / "one"), str(tmp_path / "two"))[0] == 0


@pytest.mark.parametrize("outside_matches", [True, False])
def test_a_path_leaving_the_folder_is_refused_and_never_an_oracle(
    outside_matches: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, secret_dir = tmp_path / "ckpt", tmp_path / "elsewhere"
    (folder / "sub").mkdir(parents=True)
    secret_dir.mkdir()
    model = torch.nn.Linear(2, 2)
    torch.save(model.state_dict(), folder / "model.pt")
    (folder / "sub" / "secret.txt").write_text("guess")
    Auditor(model).checkpoint_saved(folder, 1)
    shutil.rmtree(folder / "sub")
    (secret_dir / "secret.txt").write_text("guess" if outside_matches else "other")
    os.symlink(secret_dir, folder / "sub")
    for argv in (["verify", str(folder)], ["diff", "--full", str(folder), str(folder)]):
        code, text = _cli(capsys, *argv)
        assert code == 2 and "leads outside the checkpoint folder" in text, text
        assert "guess" not in text and "bytes" not in text
    os.remove(folder / "sub")
    os.symlink("../elsewhere/secret.txt", folder / "model2.pt")
    assert _cli(capsys, "verify", str(folder))[0] == 2


def test_verify_and_diff_refuse_a_file_that_is_no_checkpoint_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    torch.save({"w": torch.ones(1)}, tmp_path / "m.pt")
    for argv in (["verify", str(notes)], ["diff", str(notes), str(tmp_path / "m.pt")]):
        code, text = _cli(capsys, *argv)
        assert code == 2 and "not a PyTorch checkpoint" in text, text


def test_check_fails_when_a_resume_differs_and_json_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.chdir(tmp_path)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    audit = LoopAudit(model, opt, verbose=False)
    report = ReportWriter("resume.jsonl")
    for _ in range(4):
        opt.step()
        sched.step()
    torch.save({"model": model.state_dict()}, "step4.pt")
    report.write(audit.checkpoint_saved("step4.pt", 4, resume=ResumeSources(lr_schedulers=[sched])))
    assert _cli(capsys, "check", "resume.jsonl")[0] == 0
    fresh = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with pytest.warns(Warning):
        report.write(audit.checkpoint_loaded("step4.pt", 4, resume=ResumeSources(lr_schedulers=[fresh])))
    code, text = _cli(capsys, "check", "resume.jsonl")
    assert code == 1 and "CHECKPOINT FAILED: step4.pt" in text and "lr scheduler restarted" in text, text
    code, text = _cli(capsys, "check", "--json", "resume.jsonl")
    doc: dict[str, Any] = json.loads(text)
    assert code == 1 and doc["status"] == "checkpoint" and doc["checkpoints"][0]["resume"] == "differs"
    os.remove("step4.pt.weightsync.json")  # a load with no sidecar: unverified
    with pytest.warns(Warning):
        report.write(audit.checkpoint_loaded("step4.pt", 4))
    doc = json.loads(_cli(capsys, "check", "--json", "resume.jsonl")[1])
    assert [(f["status"], f["resume"]) for f in doc["checkpoints"]] == [("matching", "differs"), ("unverified", None)]


def test_the_progress_bar_shows_on_a_terminal_after_a_second_and_never_in_a_pipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pty
    import time

    from weightsync_audit.cli.checkpoints import progress_bar

    torch.save({"w": torch.ones(4)}, tmp_path / "m.pt")
    with progress_bar([str(tmp_path / "m.pt")], "verify") as tick:
        assert tick is None  # pytest's stderr is no terminal: nothing drawn
    master, slave = pty.openpty()
    monkeypatch.setattr("sys.stderr", os.fdopen(slave, "w"))
    os.set_blocking(master, False)

    def read_once(wait: float) -> tuple[str, float]:
        t0 = time.monotonic()
        with progress_bar([str(tmp_path / "m.pt")], "verify") as tick:
            assert tick is not None
            tick(100)
            time.sleep(wait)
            tick(100)
        took = time.monotonic() - t0
        out = b""
        while True:
            try:
                out += os.read(master, 1 << 16)
            except BlockingIOError:
                return out.decode(errors="replace"), took

    # A quick read draws nothing; on a loaded host a "quick" read may itself last a second: tried again.
    quick = [read_once(0.0) for _ in range(5)]
    assert any(took < 0.9 for _, took in quick), quick
    assert all("verify" not in out for out, took in quick if took < 0.9), quick
    slow, _ = read_once(1.1)
    assert "verify" in slow, slow
