"""Honest verdicts (issue 11): one record on every rank, ties named, sampling that rotates and does not
overclaim, hints that read the live wrapper and keep their cause, a parent process that is not told
"in sync" about a run it did not see, and logs that keep a verdict on one line."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import run_ranks
from rich.console import Console
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from weightsync_audit import Auditor, AuditResult, Mismatch, audit, maybe_rewrap, resync
from weightsync_audit.cli import main
from weightsync_audit.cli.reports import cmd_show
from weightsync_audit.engine.explain import Evidence, explain
from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit
from weightsync_audit.reporting.jsonl import ReportWriter


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _without_clock(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in ("time", "duration_ms")}


# -- 1. one record on every rank -------------------------------------------------------------------


def _checkpoint_on_rank0_only(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    if rank == 0:  # as if a checkpoint with Adam state was loaded here only
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    return audit(model, opt, step=5).to_dict()


def test_a_structure_difference_gives_the_same_record_checked_counts_included_on_four_ranks() -> None:
    recs = [_without_clock(r) for r in run_ranks(_checkpoint_on_rank0_only, 4)]
    assert all(r == recs[0] for r in recs), [r["checked"] for r in recs]
    # Counted over the union of what the ranks hold: 4 params, 3 Adam entries each, 1 lr.
    assert recs[0]["checked"]["param"] == 4 and recs[0]["checked"]["optimizer"] >= 12
    assert not recs[0]["in_sync"]


# -- 2. ties -----------------------------------------------------------------------------------------


def _two_two_split(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    if rank >= 2:
        with torch.no_grad():
            model[0].weight += 1.0
    r = audit(model, step=1)
    return {"record": r.to_dict(), "summary": r.summary()}


def test_a_two_two_split_is_named_a_tie_in_the_detail_the_summary_and_check(tmp_path: Path, capsys: Any) -> None:
    got = run_ranks(_two_two_split, 4)[0]
    [m] = got["record"]["mismatches"]
    assert m["ranks"] == [2, 3] and m["reference_ranks"] == [0, 1]
    assert "tie vote: ranks [0, 1] vs ranks [2, 3]" in m["detail"]
    assert "TIE vote" in got["summary"]
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(got["record"]) + "\n")
    assert main(["check", str(path)]) == 1
    assert "TIE: 0.weight: ranks [0, 1] vs ranks [2, 3]" in capsys.readouterr().out


def _minority_source(rank: int, world: int, mode: str) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:  # rank 0, the default resync_src, holds the odd value
        with torch.no_grad():
            model[2].bias += 1.0
    healthy = model[2].bias.detach().clone() if rank == 1 else None
    if mode == "callback":  # the callbacks' runner, as WeightSyncAudit(on_mismatch="resync") drives it
        from weightsync_audit import AuditOptions
        from weightsync_audit.integrations.session.runner import AuditRunner

        runner = AuditRunner(AuditOptions(on_mismatch="resync", resync_src=0, verbose=False))
        runner.open(world_size=world, is_main=rank == 0)
        result = runner.run(model, [opt], step=3, epoch=0, hook="on_train_batch_end", is_main=rank == 0)
        runner.close()
        assert result is not None
        notes, action = result.notes, result.action
    else:
        resync(model, opt, src="majority")
        notes, action = [], "resynced"
    after = audit(model, opt, step=4)
    return {"in_sync": after.in_sync, "bias": model[2].bias.tolist(), "healthy": healthy, "notes": notes, "a": action}


@pytest.mark.parametrize("mode", ["callback", "majority"])
def test_resync_never_copies_a_minority_value_over_the_majority(mode: str) -> None:
    got = run_ranks(_minority_source, 3, mode)
    healthy = got[1]["healthy"].tolist()
    assert all(g["in_sync"] and g["bias"] == healthy for g in got), "every rank holds the majority value"
    if mode == "callback":
        assert got[0]["a"] == "resynced"
        assert any("resync_src=0 holds a minority value of 2.bias" in n for n in got[0]["notes"]), got[0]["notes"]


def test_resync_plan_takes_each_tensor_from_a_reference_holder_and_honours_the_source_on_a_tie() -> None:
    from weightsync_audit.engine.repair.plan import plan_resync

    ms = [
        Mismatch("a", "param", [0], [1, 2]),
        Mismatch("b", "param", [2], [0, 1]),
        Mismatch("c", "param", [1], [0], detail="tie vote: rank 0 vs rank 1 hold different values"),
        Mismatch("a.grad", "grad", [0], [1, 2]),
    ]
    assert plan_resync(ms, 0).sources == {0: ["b", "c"], 1: ["a"]}
    assert plan_resync(ms, 1).sources == {1: ["a", "b", "c"]}
    assert plan_resync(ms, "majority").sources == {0: ["b", "c"], 1: ["a"]}
    assert any("tie vote on c" in n for n in plan_resync(ms, "majority").notes)


# -- 3. sampling ----------------------------------------------------------------------------------


def _late_slice_edit(rank: int, world: int) -> list[dict[str, Any]]:
    m = nn.Module()
    m.register_buffer("big", torch.zeros(40_000))  # 160 KB: sampled in 8 slices
    if rank == 1:
        m.big[-1] = 1.0  # only the last slice differs
    return [audit(m, step=s, coverage="1/8").to_dict() for s in range(8)]


def test_one_shot_sampled_audits_rotate_by_step_and_never_claim_full_sync(tmp_path: Path, capsys: Any) -> None:
    recs = run_ranks(_late_slice_edit, 2)[0]
    assert [r["in_sync"] for r in recs] == [True] * 7 + [False]
    assert [r["coverage"] for r in recs] == [f"{s % 8 + 1}/8" for s in range(8)]
    assert all(r["last_full_sync_step"] is None for r in recs), "a sampled audit never verified every byte"
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs[:7]))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "every rank holding the same weights" not in out
    assert "read 1/8 of each large tensor" in out and "last full verification in sync: never" in out


# -- 4. hints --------------------------------------------------------------------------------------


def _hint_cases(rank: int, world: int) -> dict[str, list[str]]:
    out = {}
    # (a) An Auditor bound to a wrapper that maybe_rewrap replaced: the live wrapper covers layer 0.
    model = _model()
    model[0].requires_grad_(False)
    old = DDP(model)
    auditor = Auditor(old)
    model[0].requires_grad_(True)
    maybe_rewrap(old)
    if rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] += 1.0  # an unrelated edit
    out["retired"] = auditor.audit(step=0).hints
    # (b) Unfrozen after the wrap, no re-wrap: the params and their Adam moments drift.
    model = _model()
    model[0].requires_grad_(False)
    ddp = DDP(model)
    model[0].requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.manual_seed(rank)
    ddp(torch.randn(2, 4)).sum().backward()
    opt.step()
    out["unfrozen"] = audit(ddp, opt, step=1).hints
    # (c) An EMA copy (no grad) updated from each rank's own values.
    model = _model()
    model.ema = nn.Linear(4, 8)
    model.ema.requires_grad_(False)
    ddp = DDP(model)
    with torch.no_grad():
        model.ema.weight.mul_(0.9).add_(0.1 * rank)
    out["ema"] = audit(ddp, step=2).hints
    # (d) BatchNorm with forward_sync_buffers=False.
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ddp = DDP(bn, forward_sync_buffers=False)
    torch.manual_seed(rank)
    ddp(torch.randn(3, 4))
    out["buffers"] = audit(ddp, include=("buffers",), step=3).hints
    return out


def test_hints_read_the_live_wrapper_keep_the_resync_fix_name_ema_and_forward_sync_buffers() -> None:
    got = run_ranks(_hint_cases, 2)[0]
    assert not any("does not all-reduce" in h for h in got["retired"]), got["retired"]
    [unfrozen] = [h for h in got["unfrozen"] if "does not all-reduce" in h]
    assert "resync it once, optimizer state included" in unfrozen
    assert "EMA" in got["ema"][0] and not any("after DDP's broadcast" in h for h in got["ema"]), got["ema"]
    assert "forward_sync_buffers=False" in got["buffers"][0] and "broadcast_buffers" in got["buffers"][0]


def test_an_optimizer_cause_stays_named_once_the_parameters_follow() -> None:
    ms = [Mismatch("param_groups.0.lr", "optimizer", [1], [0]), Mismatch("0.weight", "param", [1], [0])]
    hints = explain(Evidence(ms))
    assert hints[0].startswith("The learning rate differs (param_groups.0.lr) and the parameters have followed")
    assert not any("likely their gradients are not all-reduced" in h for h in hints)


def test_the_summary_names_a_diverged_param_before_optimizer_entries() -> None:
    r = AuditResult(
        in_sync=False,
        step=4,
        world_size=2,
        mismatches=[Mismatch("0.weight.exp_avg", "structure", [1], [0]), Mismatch("0.weight", "param", [1], [0])],
    )
    assert "(first: 0.weight)" in r.summary()


# -- 5. the parent of ddp_spawn / ddp_fork ---------------------------------------------------------


def test_a_parent_that_ran_no_audit_reads_the_report_or_says_where_the_audits_ran(tmp_path: Path) -> None:
    assert "no audit ran in this process" in WeightSyncAudit().summary()
    assert "in sync throughout" not in WeightSyncAudit().summary()
    path = tmp_path / "audit.jsonl"
    with ReportWriter(path) as w:
        w.write(AuditResult(in_sync=True, step=3, world_size=2, last_in_sync_step=3))
        w.write(
            AuditResult(
                in_sync=False, step=4, world_size=2, last_in_sync_step=3, mismatches=[Mismatch("w", "param", [1], [0])]
            )
        )
    text = WeightSyncAudit(report_path=str(path)).summary()
    assert "2 audit(s), 1 found divergence; first at step 4 (w); last in sync at step 3" in text
    assert "read back from" in text


@pytest.mark.parametrize("with_report", [False, True])
def test_after_ddp_fork_the_parents_summary_reports_the_workers_divergence(tmp_path: Path, with_report: bool) -> None:
    from lightning_helpers import Perturb, SmallModel, fit

    def nudge(trainer: Any, module: Any) -> None:
        module.net[-1].weight[0, 0] += 1e-3

    report = str(tmp_path / "a.jsonl") if with_report else None
    cb = WeightSyncAudit(every_n_train_steps=1, hooks=(), report_path=report, verbose=False)
    fit(tmp_path, SmallModel(), [Perturb(1, 4, nudge), cb], max_epochs=1)
    text = cb.summary()
    assert "8 audit(s), 5 found divergence; first at step 4 (net.2.weight)" in text, text
    assert "in sync throughout" not in text and "worker processes" in text


# -- 7. logs ----------------------------------------------------------------------------------------


def _long_divergence() -> AuditResult:
    name = "encoder.layers.11.self_attention.query_key_value.weight"
    return AuditResult(
        in_sync=False,
        step=49,
        epoch=3,
        world_size=2,
        checked={"param": 120},
        mismatches=[
            Mismatch(name, "param", [1], [0], [16, 32], "float32", 0.0031),
            Mismatch(name + "2", "param", [1], [0]),
        ],
    )


def test_off_a_terminal_a_verdict_stays_on_one_line(tmp_path: Path, capsys: Any) -> None:
    from weightsync_audit.reporting.render import log_console

    buf = io.StringIO()
    log_console(buf).print(_long_divergence())
    [line] = [x for x in buf.getvalue().splitlines() if "DIVERGED" in x]
    assert "rank(s) [1]" in line and "(first: encoder.layers.11.self_attention.query_key_value.weight)" in line
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(_long_divergence().to_dict()) + "\n")
    main(["check", str(path)])
    out = capsys.readouterr().out
    [tensors] = [x for x in out.splitlines() if x.startswith("  tensors:")]
    assert tensors.count("query_key_value.weight") == 2, out


def test_the_show_timeline_tells_in_sync_sampled_and_diverged_apart_without_colour(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    with ReportWriter(path) as w:
        w.write(AuditResult(in_sync=True, step=1))
        w.write(AuditResult(in_sync=True, step=2, coverage="2/8"))
        w.write(AuditResult(in_sync=False, step=3, mismatches=[Mismatch("w", "param", [1], [0])]))
    buf = io.StringIO()
    cmd_show(str(path), console=Console(file=buf, no_color=True, width=120))
    [strip] = [x for x in buf.getvalue().splitlines() if x.startswith("timeline:")]
    assert "=" in strip and "~" in strip and "X" in strip
