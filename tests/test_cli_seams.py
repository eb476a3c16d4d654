"""The command line as one tool: no wrapping off a terminal, plain one-line refusals, "-" for a missing
step, an explicit way to accept a repaired run, exit codes and help that stand alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from records import CONTRACT_EXAMPLE

from weightsync_audit import AuditResult, Mismatch, ReportWriter
from weightsync_audit.cli import build_parser, main

LONG = "encoder.layers.0.self_attention.query_key_value.weight_with_a_rather_long_descriptive_name"


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a CI job runs it: stdout a pipe, no COLUMNS set."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run(
        [sys.executable, "-m", "weightsync_audit", *argv], capture_output=True, text=True, env=env, timeout=120
    )


def _write(path: Path, results: list[AuditResult]) -> Path:
    with ReportWriter(path) as w:
        for r in results:
            w.write(r)
    return path


def test_diff_off_a_terminal_keeps_every_row_on_one_line(tmp_path: Path) -> None:
    torch.save({LONG: torch.zeros(64, 64)}, tmp_path / "a.pt")
    torch.save({LONG: torch.ones(64, 64)}, tmp_path / "b.pt")
    proc = _cli("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    assert proc.returncode == 1, proc.stderr
    row = [ln for ln in proc.stdout.splitlines() if LONG in ln]
    assert len(row) == 1 and "float32 64x64" in row[0] and "4096/4096" in row[0], proc.stdout
    assert any(
        ln.startswith("DIFFERENT: ") and ln.endswith("0 of 1 shared entries equal") for ln in proc.stdout.splitlines()
    )


def test_diff_with_atol_says_equal_within_atol_not_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"w": torch.zeros(4), "b": torch.ones(2)}, tmp_path / "a.pt")
    torch.save({"w": torch.tensor([0.0, 5e-4, 0.0, 0.0]), "b": torch.ones(2)}, tmp_path / "b.pt")
    assert main(["diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--atol", "1e-3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("EQUAL within atol 0.001: ") and "IDENTICAL" not in out
    assert "1 of 2 entries differ, all within atol (largest max |diff| 0.0005)" in out
    assert main(["diff", str(tmp_path / "a.pt"), str(tmp_path / "a.pt"), "--atol", "1e-3"]) == 0
    assert capsys.readouterr().out.startswith("IDENTICAL: ")
    assert main(["diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--atol", "1e-3", "--json"]) == 0
    pair = json.loads(capsys.readouterr().out)["pairs"][0]
    assert (pair["identical"], pair["exact"], pair["within_atol"]) == (True, False, 1)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (json.dumps(CONTRACT_EXAMPLE).encode() + b"\n", "it is JSON text (an audit report?"),
        (b"hello, these are notes\n", "it is a text file"),
        (b"", "the file is empty"),
        (bytes(range(256)) * 4, "neither a zip archive nor a pickle"),
    ],
)
def test_diff_on_a_file_that_is_no_checkpoint_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, said: str
) -> None:
    path = tmp_path / "thing.jsonl"
    path.write_bytes(content)
    torch.save({"w": torch.zeros(1)}, tmp_path / "b.pt")
    assert main(["diff", str(path), str(tmp_path / "b.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: not a PyTorch checkpoint: " in err and said in err, err
    assert "allow-list" not in err and "refused" not in err


@pytest.mark.parametrize("cmd", ["show", "check"])
def test_a_binary_file_is_one_line_not_an_audit_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cmd: str
) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.randn(4096)}, path)
    assert main([cmd, str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "not an audit report" in out.err, out
    noise = tmp_path / "noise.bin"
    noise.write_bytes(bytes([0, 255, 7, 10]) * 500)
    assert main([cmd, str(noise)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_many_invalid_text_lines_are_capped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(f"not json {i}\n" for i in range(99)))
    assert main(["show", str(path)]) == 2
    out = capsys.readouterr().out
    assert out.count("invalid: ") == 10 and "... and 89 more invalid line(s)" in out


def test_a_record_without_a_step_prints_a_dash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = Mismatch("w", "param", [1], [0], [2], "float32", 0.5)
    path = _write(
        tmp_path / "r.jsonl",
        [
            AuditResult(in_sync=True, world_size=2),
            AuditResult(in_sync=False, world_size=2, mismatches=[m], action="warned"),
        ],
    )
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert main(["check", str(path)]) == 1
    checked = capsys.readouterr().out
    for text in (shown, checked):
        assert "None" not in text, text
    assert "steps - .. -" in shown and "first divergence: step -" in checked and "at the end (step -)" in checked


def _resync_run(tmp_path: Path, end_in_sync: bool = True) -> Path:
    m = Mismatch("w", "param", [1], [0, 2], [2], "float32", 0.5)
    records = [
        AuditResult(in_sync=True, step=1, world_size=3),
        AuditResult(in_sync=False, step=2, world_size=3, mismatches=[m], action="resynced"),
        AuditResult(in_sync=True, step=3, world_size=3),
    ]
    if not end_in_sync:
        records.append(AuditResult(in_sync=False, step=4, world_size=3, mismatches=[m], action="warned"))
    return _write(tmp_path / f"resync-{end_in_sync}.jsonl", records)


def test_check_accepts_a_run_repaired_by_resync_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _resync_run(tmp_path)
    assert main(["check", str(path)]) == 1
    assert "pass --accept-repaired to exit 0" in capsys.readouterr().out
    assert main(["check", str(path), "--accept-repaired"]) == 0
    assert "REPAIRED: 1 of 3 audit(s)" in capsys.readouterr().out
    assert main(["check", str(path), "--accept-repaired", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["status"], doc["repaired"], doc["exit_code"]) == ("repaired", True, 0)
    # A run still diverged at the end is not accepted.
    assert main(["check", str(_resync_run(tmp_path, end_in_sync=False)), "--accept-repaired"]) == 1


def test_help_stands_alone_and_documents_every_exit_code() -> None:
    parser = build_parser()
    text = parser.format_help()
    assert "source tree" not in text and "docs/cli.md" not in text
    for line in ("check  0 every audit in sync", "show   0 shown, 2", "diff   0 identical (or equal within --atol)"):
        assert line in text
    sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert "--accept-repaired" in sub["check"].format_help()
    assert "pip install matplotlib" in sub["show"].format_help()


def test_the_plot_colour_scale_keeps_a_decade_and_labels_whole_decades(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from weightsync_audit.reporting.plot import color_range, plot_report

    lo, hi = color_range([9.996e-5, 1e-4])
    assert hi / lo == pytest.approx(10.0) and lo < 9.996e-5 < 1e-4 < hi
    assert color_range([1e-6, 1e-2]) == (1e-6, 1e-2)  # a wide range is kept as measured
    records = [
        AuditResult(
            in_sync=False,
            step=s,
            world_size=2,
            action="warned",
            mismatches=[Mismatch("fc.weight", "param", [1], [0], [2], "float32", 1e-4 - s * 1e-8)],
        )
        for s in range(1, 5)
    ]
    out = plot_report(records, tmp_path / "run.svg")
    svg = out.read_text()
    # Labelled at the whole decade only, in scientific notation; no minor tick labels.
    labels = re.findall(r"<!-- \$\\mathdefault\{(.*?)\}\$ -->", svg)
    assert "10^{-4}" in labels, labels
    assert not [t for t in labels if "times" in t], labels  # no 9.9965e-5 style labels, on either panel


def test_every_command_module_owns_its_parser_and_its_run_and_the_dispatcher_registers_each() -> None:
    import importlib
    import pkgutil

    import weightsync_audit.cli as cli
    from weightsync_audit.cli import one_line

    # command: what the commands share; lightning_20340: the demo's scenario (its model and data)
    modules = {m.name for m in pkgutil.iter_modules(cli.__path__)} - {"command", "lightning_20340"}
    assert set(cli.HOMES.values()) == modules, "a module of cli/ holds commands, or is command.py's shared part"
    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert list(sub) == list(cli.COMMANDS) == list(cli.HOMES)
    for name in cli.COMMANDS:
        home = importlib.import_module(f"weightsync_audit.cli.{cli.HOMES[name]}")
        module = getattr(home, name.upper(), home)
        assert sub[name].get_default("run") is module.run, name
        assert sub[name].description == one_line(module.DESCRIPTION) and "\n" not in sub[name].description


def test_the_library_code_lives_outside_cli_and_print_report_stays_public() -> None:
    import weightsync_audit as wa
    from weightsync_audit import errors
    from weightsync_audit.engine.checkpoints import diff, load, offline
    from weightsync_audit.reporting import summary, terminal

    assert wa.print_report is terminal.print_report
    assert diff.CheckpointError is load.CheckpointError is errors.CheckpointError
    assert issubclass(errors.UnsafeCheckpointError, errors.CheckpointError)
    assert callable(offline.verify_checkpoint) and callable(summary.ReportSummary.read)
