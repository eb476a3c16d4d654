"""A plain training loop on par with the callbacks: LoopAudit (on_mismatch, report_path, verbose) on real
gloo ranks, a public render of a result and of a report, a summary that carries the pinpointed step, the
writer and reader at the top level and the report's old path kept."""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import RankDied, run_ranks

import weightsync_audit
from weightsync_audit import AuditResult, LoopAudit, Mismatch, WeightDivergenceError, read_report


def _loop(rank: int, world: int, on_mismatch: str, report: str | None, nudge_every: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    audit = LoopAudit(model, opt, every_n_steps=2, on_mismatch=on_mismatch, report_path=report, pinpoint=True)
    out = io.StringIO()
    from rich.console import Console

    audit.runner.console = Console(file=out, width=10_000, soft_wrap=True)
    actions, raised = [], False
    seen = warnings.catch_warnings(record=True)
    caught = seen.__enter__()
    warnings.simplefilter("always")
    try:
        for step in range(1, 9):
            opt.zero_grad()
            model(torch.ones(2, 4)).square().sum().backward()  # the same batch everywhere: a real step
            opt.step()
            if rank == 1 and step % nudge_every == 3 % nudge_every and step >= 3:
                with torch.no_grad():
                    model[0].weight[0, 0] += 1e-3  # a replica drifts: the same cause every time
            result = audit.step(step, epoch=0)
            if result is not None:
                actions.append(result.action)
    except WeightDivergenceError as exc:
        raised = exc.result.first_diverged_step == 3
    audit.close()
    seen.__exit__(None, None, None)
    ours = [w for w in caught if issubclass(w.category, weightsync_audit.WeightSyncWarning)]
    said, files = [str(w.message) for w in ours], [w.filename for w in ours]
    return {
        "warned_from": files,
        "actions": actions,
        "raised": raised,
        "printed": out.getvalue(),
        "summary": audit.summary(),
        "warned": said,
    }


def test_loop_audit_raise_on_every_rank_with_the_pinpointed_step(tmp_path: Path) -> None:
    report = tmp_path / "loop.jsonl"
    results = run_ranks(_loop, 2, "raise", str(report), 100)
    assert [r["raised"] for r in results] == [True, True]  # both ranks, at the same audit, pinpointed
    printed = results[0]["printed"]
    assert "DIVERGED" in printed and "diverged from step 3" in printed and results[1]["printed"] == ""
    records = [r for _, r in read_report(report).records]
    assert [r.action for r in records] == ["none", "raised"]


def test_loop_audit_resync_repairs_and_a_persisting_cause_is_said_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "resync.jsonl"
    results = run_ranks(_loop, 2, "resync", str(report), 2)
    main = results[0]
    assert main["actions"] == ["none", "resynced", "resynced", "resynced"]
    printed = main["printed"]
    # The first repair is reported whole, each repeat of the same cause in one line.
    assert printed.count("DIVERGED") == 1, printed
    assert "resynced again, 2 times, same cause" in printed and "resynced again, 3 times, same cause" in printed
    # After ESCALATE_AFTER repairs of the same tensors, one warning that the cause persists.
    assert len([w for w in main["warned"] if "the cause persists" in w]) == 1, main["warned"]
    assert main["warned_from"] == [__file__]  # the user's loop, not the library's internals
    assert results[1]["warned"] == [] and "3 resync(s)" in main["summary"]
    from weightsync_audit.cli import main as cli

    assert cli(["check", str(report)]) == 1
    capsys.readouterr()
    # The cause came back after each repair: not repaired, whatever --accept-repaired says (issue 42 item 15).
    assert cli(["check", str(report), "--accept-repaired"]) == 1
    assert "NOT REPAIRED: a cause came back after its repair, 2 time(s)" in capsys.readouterr().out


def _tie_result() -> AuditResult:
    detail = "tie vote: rank 0 vs rank 1 hold different values in equal numbers, no majority"
    ms = [Mismatch(f"layer.w{i}", "param", [1], [0], [4, 4], "float32", 0.5, detail) for i in range(3)]
    return AuditResult(
        in_sync=False, step=7, world_size=2, mismatches=ms, action="warned", first_diverged_step=5, pinpoint="exact"
    )


def test_summary_carries_the_pinpointed_step() -> None:
    assert "diverged from step 5 (pinpointed, exact)" in _tie_result().summary()


def test_render_prints_a_result_and_says_a_tie_once() -> None:
    out = io.StringIO()
    weightsync_audit.render(_tie_result(), file=out)
    text = out.getvalue()
    assert text.lower().count("tie") == 1, text
    assert "DIVERGED" in text and "layer" in text


def test_print_report_writer_and_reader_at_the_top_level(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with weightsync_audit.ReportWriter(path) as w:
        w.write(_tie_result())
    out = io.StringIO()
    assert weightsync_audit.print_report(str(path), file=out) == 0
    assert "layers that diverged" in out.getvalue()
    assert weightsync_audit.print_report(str(tmp_path / "missing.jsonl"), file=io.StringIO()) == 2


def test_check_says_a_tie_once_not_in_every_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from weightsync_audit.cli import main

    path = tmp_path / "tie.jsonl"
    with weightsync_audit.ReportWriter(path) as w:
        w.write(_tie_result())
    assert main(["check", str(path)]) == 1
    text = capsys.readouterr().out.split("\n", 1)[1]  # past the headline, which names the file
    assert text.lower().count("tie") == 1 and "None" not in text, text


def test_loop_audit_names_a_bad_argument() -> None:
    with pytest.raises(ValueError, match="every_n_steps=0"):
        LoopAudit(torch.nn.Linear(2, 2), every_n_steps=0)
    with pytest.raises(ValueError, match="on_mismatch='explode'"):
        LoopAudit(torch.nn.Linear(2, 2), on_mismatch="explode")  # type: ignore[arg-type]


def test_tables_are_capped_and_every_dash_is_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ms = [Mismatch(f"l{i // 2}.w{i}", "param", [1], [0], [4, 4], "float32", 0.5 if i < 8 else None) for i in range(84)]
    result = AuditResult(in_sync=False, step=3, world_size=3, mismatches=ms, action="warned")
    out = io.StringIO()
    weightsync_audit.render(result, file=out)
    text = out.getvalue()
    assert text.count("float32") == 20 and "... and 64 more tensor(s)" in text
    assert "max |diff| -: not measured" in text
    from weightsync_audit.cli import main

    path = tmp_path / "many.jsonl"
    with weightsync_audit.ReportWriter(path) as w:
        w.write(AuditResult(in_sync=True, step=1, world_size=3))
        w.write(result)
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "... and 12 more layer(s)" in shown and "-: in sync (no tensor differs)" in shown
    assert "-: max |diff| not measured" in shown


def _loop_checkpoints(rank: int, world: int, folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = f"{folder}/model.pt"
    with LoopAudit(model, opt, verbose=False, report_path=f"{folder}/audit.jsonl") as audit:
        if rank == 0:
            torch.save(model.state_dict(), path)
        dist.barrier()
        saved = audit.checkpoint_saved(path, step=4)
        if rank == 1:  # rank 1 resumes from something else than what was saved
            with torch.no_grad():
                model.bias += 0.5
        loaded = audit.checkpoint_loaded(path, step=4)
    assert saved is not None and loaded is not None
    return {
        "saved": saved.checkpoint["status"],
        "loaded": loaded.checkpoint["status"],
        "mismatches": [(m.name, m.ranks) for m in loaded.mismatches],
    }


def test_loop_audit_verifies_a_checkpoint_it_saved_and_names_the_rank_that_resumed_from_something_else(
    tmp_path: Path,
) -> None:
    for r in run_ranks(_loop_checkpoints, 2, str(tmp_path)):
        assert r["saved"] == "verified" and r["loaded"] == "changed"
        assert ("bias", [1]) in r["mismatches"], r
    assert (tmp_path / "model.pt.weightsync.json").exists()


def _loop_exit(rank: int, world: int, report: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    audit = LoopAudit(model, every_n_steps=1, on_mismatch="raise", exit_code=17, report_path=report, verbose=False)
    if rank == 1:
        with torch.no_grad():
            model.weight[0, 0] += 1.0
    audit.step(1)
    raise AssertionError("unreachable: a divergence under exit_code ends the process")


def test_loop_audit_exit_code_ends_every_rank_with_it_after_the_record_is_written(tmp_path: Path) -> None:
    report = tmp_path / "audit.jsonl"
    ranks = run_ranks(_loop_exit, 2, str(report), may_die=[0, 1])
    assert [(type(r), r.exitcode) for r in ranks] == [(RankDied, 17), (RankDied, 17)]
    ((_, record),) = read_report(report).records
    assert not record.in_sync and record.mismatches[0].name == "weight"
    with pytest.raises(ValueError, match="exit_code"):
        LoopAudit(torch.nn.Linear(1, 1), exit_code=17)  # acts under on_mismatch="raise" only
