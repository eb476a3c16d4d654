"""The ``weightsync-audit`` command line on real files: reports from real runs and from ReportWriter,
checkpoints from torch.save and a real Lightning fit, and a malicious pickle that must never run."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from weightsync_audit import AuditResult, Mismatch
from weightsync_audit.cli import main
from weightsync_audit.reporting.jsonl import ReportWriter

BIN = Path(sys.executable).with_name("weightsync-audit")


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at 80 columns when not on a terminal


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# -- the demo, and the real reports it writes ---------------------------------------------------


@pytest.fixture(scope="module")
def demo(demo_run: dict[str, Any]) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``weightsync-audit demo --epochs 4 --report FOLDER`` (2 ranks, the default) through the installed console
    script (what ``make demo`` runs), off a terminal: the session's one run (tests/conftest.py ``demo_run``),
    which the docs' pages that run the same command check too."""
    proc = subprocess.CompletedProcess(["weightsync-audit", "demo"], demo_run["returncode"], demo_run["stdout"],
                                       demo_run["stderr"])  # fmt: skip
    return proc, Path(demo_run["report"])


def test_demo_shows_the_divergence_then_the_fix(demo: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "DIVERGED" in text and "first at step 49 (epoch 3)" in text
    # The hint is said once: in the trainable-set warning; the report that follows refers to it.
    assert text.count("backbone.weight, backbone.bias require grad") == 1
    assert "hint: the cause and its fix are in the warning at step 48 above" in text
    assert "DDPRewrapOnTrainableChange" in text
    assert "in sync throughout" in text
    assert text.index("first at step 49") < text.index("run 2/2")
    assert "Traceback" not in proc.stderr
    # Off a terminal nothing is wrapped at 80 columns: the introduction is one line, a rule a short one.
    lines = text.splitlines()
    assert any(ln.startswith("A 32->16 backbone") and ln.endswith("WeightSyncAudit checks every step.") for ln in lines)
    assert max(len(ln) for ln in lines) < 1000
    assert (out / "without-fix.jsonl").exists() and (out / "with-fix.jsonl").exists()


def test_check_on_the_demo_reports(capsys: pytest.CaptureFixture[str], demo: Any) -> None:
    _, out = demo
    code, text, _ = run(capsys, "check", str(out / "without-fix.jsonl"))
    assert code == 1
    assert "first divergence: step 49 (epoch 3" in text
    assert "backbone.weight" in text and "backbone.bias" in text
    assert "ranks: [1] differ from the reference held by [0]" in text
    assert "hint:" in text
    code, text, _ = run(capsys, "check", str(out / "with-fix.jsonl"))
    assert code == 0 and "IN SYNC" in text

    code, text, _ = run(capsys, "check", "--json", str(out / "without-fix.jsonl"))
    doc = json.loads(text)
    assert code == 1 and doc["status"] == "diverged" and doc["exit_code"] == 1
    first = doc["first_divergence"]
    assert (first["step"], first["epoch"], first["ranks"], first["last_in_sync_step"]) == (49, 3, [1], 48)
    assert first["tensors"] == ["backbone.weight", "backbone.bias"]
    assert first["hints"] and "DistributedDataParallel" in first["hints"][0]


def test_python_dash_m_runs_the_same_cli(demo: Any) -> None:
    _, out = demo
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync_audit", "check", str(out / "with-fix.jsonl")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "IN SYNC" in proc.stdout


def test_show_on_a_real_report_with_plots(capsys: pytest.CaptureFixture[str], demo: Any, tmp_path: Path) -> None:
    _, out = demo
    png = tmp_path / "run.png"
    code, text, _ = run(capsys, "show", str(out / "without-fix.jsonl"), "--plot", str(png))
    assert code == 0
    assert "timeline" in text and "layers that diverged" in text
    assert "0-48" in text and "49-64" in text  # the in-sync stretch, then the diverged one
    assert "backbone" in text and "1 vs 0" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "layers.svg"
    assert main(["show", str(out / "without-fix.jsonl"), "--plot", str(svg), "--by", "layer"]) == 0
    assert b"<svg" in svg.read_bytes()[:500]


def test_plot_without_matplotlib_says_how_to_get_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    report = tmp_path / "a.jsonl"
    with ReportWriter(report) as w:
        w.write(AuditResult(in_sync=True, step=1))
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, _, err = run(capsys, "show", str(report), "--plot", str(tmp_path / "x.png"))
    assert code == 2
    assert "pip install matplotlib" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.png").exists()


# -- check / show on reports written by ReportWriter --------------------------------------------


def _diverged(step: int, epoch: int = 0, gap: float | None = 0.5) -> AuditResult:
    m = Mismatch("encoder.weight", "param", [2], [0, 1, 3], [4, 4], "float32", gap)
    return AuditResult(
        in_sync=False, step=step, epoch=epoch, world_size=4, mismatches=[m], hints=["a hint"], action="warned"
    )


def _write(path: Path, results: list[AuditResult]) -> Path:
    with ReportWriter(path) as w:
        for r in results:
            w.write(r)
    return path


def test_check_in_sync_and_diverged(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ok = _write(tmp_path / "ok.jsonl", [AuditResult(in_sync=True, step=s, world_size=4) for s in range(3)])
    assert run(capsys, "check", str(ok))[0] == 0
    bad = _write(
        tmp_path / "bad.jsonl", [AuditResult(in_sync=True, step=0, world_size=4), _diverged(5, 1), _diverged(6, 1)]
    )
    code, text, _ = run(capsys, "check", str(bad))
    assert code == 1
    assert "step 5 (epoch 1" in text and "encoder.weight" in text and "[2] differ" in text and "a hint" in text
    code, text, _ = run(capsys, "show", str(bad))
    assert code == 0 and "2/3" in text  # the layer diverged in 2 of 3 audits


def test_check_names_an_invalid_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = _write(tmp_path / "r.jsonl", [AuditResult(in_sync=True, step=0), AuditResult(in_sync=True, step=1)])
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    record["schema"] = "something-else/9"
    lines[1] = json.dumps(record)
    path.write_text("\n".join([*lines, "not json at all"]) + "\n")
    code, text, _ = run(capsys, "check", str(path))
    assert code == 2
    assert "line 2" in text and "schema" in text
    assert "line 3" in text and "not JSON" in text
    doc = json.loads(run(capsys, "check", "--json", str(path))[1])
    assert doc["status"] == "invalid" and [e["line"] for e in doc["errors"]] == [2, 3]
    assert run(capsys, "show", str(path))[0] == 2


def test_a_torn_last_line_is_reported_as_torn(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = _write(tmp_path / "r.jsonl", [AuditResult(in_sync=True, step=0), AuditResult(in_sync=True, step=1)])
    with open(path, "ab") as f:
        f.write(b'{"schema": "weightsync-audit/1", "ti')  # a crash mid-write
    code, text, _ = run(capsys, "check", str(path))
    assert code == 2 and "line 3: torn" in text and "--allow-torn" in text
    code, text, _ = run(capsys, "check", "--allow-torn", str(path))
    assert code == 0 and "torn" in text
    doc = json.loads(run(capsys, "check", "--json", str(path))[1])
    assert doc["errors"] == [{"line": 3, "torn": True, "message": doc["errors"][0]["message"]}]


@pytest.mark.parametrize("cmd", ["check", "show"])
def test_unreadable_reports_are_one_line_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path, cmd: str) -> None:
    code, _, err = run(capsys, cmd, str(tmp_path / "missing.jsonl"))
    assert code == 2 and err.count("\n") == 1 and "no such file" in err
    code, _, err = run(capsys, cmd, str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "folder" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, text, _ = run(capsys, cmd, str(empty))
    assert code == 2 and "no audit records" in text


# -- diff -----------------------------------------------------------------------------------------


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(self.backbone(batch[0])).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real Lightning checkpoint after two steps, and the model's plain state_dict file."""
    d = tmp_path_factory.mktemp("ckpt")
    pl.seed_everything(0, verbose=False)
    model = _Net()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4))
    ckpt = d / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    sd = d / "model.pt"
    torch.save(model.state_dict(), sd)
    return ckpt, sd


def test_diff_a_lightning_checkpoint(
    capsys: pytest.CaptureFixture[str], lightning_ckpt: tuple[Path, Path], tmp_path: Path
) -> None:
    ckpt, sd = lightning_ckpt
    code, text, _ = run(capsys, "diff", str(ckpt), str(ckpt))
    assert code == 0 and "IDENTICAL" in text
    code, text, _ = run(capsys, "diff", str(ckpt), str(sd))  # the ckpt's state_dict against a plain one
    assert code == 0 and "state_dict of the Lightning checkpoint" in text

    full = torch.load(ckpt, weights_only=True)
    full["state_dict"]["backbone.weight"][0, 0] += 0.25
    full["optimizer_states"][0]["param_groups"][0]["lr"] = 0.02
    other = tmp_path / "other.ckpt"
    torch.save(full, other)
    code, text, _ = run(capsys, "diff", "--json", str(ckpt), str(other))
    assert code == 1
    diffs = {d["name"]: d for d in json.loads(text)["pairs"][0]["differences"]}
    assert diffs["state_dict.backbone.weight"]["status"] == "values"
    assert diffs["state_dict.backbone.weight"]["max_abs_diff"] == pytest.approx(0.25)
    assert diffs["state_dict.backbone.weight"]["changed"] == 1
    assert diffs["optimizer_states.0.param_groups.0.lr"]["max_abs_diff"] == pytest.approx(0.01)
    assert len(diffs) == 2
    code, text, _ = run(capsys, "diff", str(ckpt), str(other), "--exclude", "optimizer_states.*")
    assert code == 1 and "state_dict.backbone.weight" in text and "lr" not in text


def test_diff_state_dicts_every_kind_of_difference(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a = {
        "w": torch.arange(6.0).reshape(2, 3),
        "b": torch.zeros(3),
        "h": torch.ones(2),
        "gone": torch.ones(1),
        "n": torch.tensor(float("nan")),
    }
    b = {
        "w": a["w"] + torch.tensor([[0.0, 0.0, 1e-3], [0.0, 0.0, 0.0]]),
        "b": torch.zeros(4),
        "h": torch.ones(2, dtype=torch.float64),
        "new": torch.ones(1),
        "n": torch.tensor(float("nan")),  # NaN equals NaN bit for bit
    }
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    code, text, _ = run(capsys, "diff", "--json", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    assert code == 1
    got = {d["name"]: d["status"] for d in json.loads(text)["pairs"][0]["differences"]}
    assert got == {"w": "values", "b": "shape", "h": "dtype", "gone": "missing", "new": "extra"}
    code, text, _ = run(capsys, "diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    assert code == 1 and "DIFFERENT" in text and "0.001" in text
    # within --atol the values count as equal (the other differences remain)
    code, text, _ = run(capsys, "diff", "--json", "--atol", "0.01", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    assert "w" not in {d["name"] for d in json.loads(text)["pairs"][0]["differences"]}


def test_diff_folders_of_per_rank_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    sd = {"layer.weight": torch.randn(3, 3)}
    run1, run2 = tmp_path / "run1", tmp_path / "run2"
    for d in (run1, run2):
        d.mkdir()
        for r in range(3):
            torch.save(sd, d / f"rank{r}.pt")
    assert run(capsys, "diff", str(run1), str(run2))[0] == 0
    assert run(capsys, "diff", str(run1))[0] == 0  # one folder: every rank against the first
    drifted = {"layer.weight": sd["layer.weight"].clone()}
    drifted["layer.weight"][1, 1] += 1.0
    torch.save(drifted, run2 / "rank2.pt")
    code, text, _ = run(capsys, "diff", str(run2))
    assert code == 1 and "rank2.pt" in text and "IDENTICAL" in text  # rank1 matches, rank2 does not
    code, text, _ = run(capsys, "diff", "--json", str(run1), str(run2))
    pairs = json.loads(text)["pairs"]
    assert [p["identical"] for p in pairs] == [True, True, False]
    (run2 / "rank2.pt").unlink()
    code, text, _ = run(capsys, "diff", str(run1), str(run2))
    assert code == 1 and "missing" in text


class _Evil:
    """Unpickling this would create a file: proof that code from the checkpoint ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_diff_refuses_a_malicious_pickle_without_running_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, writer: str
) -> None:
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pt"
    payload = {"w": torch.ones(2), "x": _Evil(str(marker))}
    if writer == "torch.save":
        torch.save(payload, evil)
    else:
        with open(evil, "wb") as f:
            pickle.dump(payload, f)
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, good)
    for argv in (("diff", str(good), str(evil)), ("diff", str(evil), str(good))):
        code, out, err = run(capsys, *argv)
        assert code == 2
        assert "refused" in err and "weights_only=True" in err and "never executes" in err
        assert err.count("\n") == 1 and "Traceback" not in err + out
    assert not marker.exists()


def test_diff_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_text("hello, I am not a checkpoint")
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(1)}, good)
    for argv, says in (
        (("diff", str(junk), str(good)), "not a PyTorch checkpoint: it is a text file"),
        (("diff", str(good), str(tmp_path / "nope.pt")), "no such file"),
        (("diff", str(good)), "give two checkpoints"),
        (("diff", "--atol", "-1", str(good), str(good)), "--atol"),
    ):
        code, _, err = run(capsys, *argv)
        assert code == 2 and says in err and err.count("\n") == 1, err


# -- help and usage -------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", [[], ["demo"], ["check"], ["show"], ["diff"]])
def test_every_command_has_help_with_an_example(capsys: pytest.CaptureFixture[str], cmd: list[str]) -> None:
    code, text, _ = run(capsys, *cmd, "--help")
    assert code == 0
    assert "example" in text and "weightsync-audit " in text


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["check"], ["bogus"], ["diff", "a", "b", "--limit", "many"]):
        code, out, err = run(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and "--help" in err, err
    code, out, _ = run(capsys)
    assert code == 2 and "COMMAND" in out
