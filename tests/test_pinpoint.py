"""Pinpoint and tolerance on real gloo ranks: the exact step replicas parted, and the size of the gap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

from weightsync_audit import Auditor, AuditResult, Mismatch, audit
from weightsync_audit.engine.timeline.answer import locate
from weightsync_audit.engine.timeline.pinpoint import StepRing

PLANTED = 37


def _same_everywhere(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("time", "duration_ms")}


def _loop(rank: int, world: int, rings: tuple[int, ...]) -> list[list[dict[str, Any]]]:
    """A hand-written data-parallel loop; rank 1 nudges a weight right after optimizer step 37.

    One auditor per ring size, all sharing one audit channel; each audits every 10 steps.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    auditors = [Auditor(model, opt, pinpoint=True, pinpoint_ring=n) for n in rings]
    for a in auditors[1:]:
        a._comm = auditors[0].comm
    torch.manual_seed(100 + rank)
    out: list[list[dict[str, Any]]] = [[] for _ in rings]
    for step in range(1, 61):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if step == PLANTED and rank == 1:
            with torch.no_grad():
                model[2].weight[0, 0] += 1e-3
        for a in auditors:
            a.record_step(step)
        if step % 10 == 0:
            for k, a in enumerate(auditors):
                out[k].append(_same_everywhere(a.audit(step=step).to_dict()))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_change_planted_at_step_37_is_pinpointed_to_37_by_audits_every_10_steps(world: int) -> None:
    # Ring sizes: the default; 5 (overflows, yet still holds step 36 in sync); 2 (too small).
    results = run_ranks(_loop, world, (1024, 5, 2))
    assert all(r == results[0] for r in results[1:])  # the same records on every rank
    exact, small_but_enough, too_small = results[0]
    assert [r["in_sync"] for r in exact] == [True, True, True, False, False, False]
    for r in exact[3:]:  # the audit at 40 found it; later ones keep the answer
        assert (r["pinpoint"], r["first_diverged_step"], r["last_in_sync_step"]) == ("exact", 37, 36)
        assert [(m["name"], m["ranks"]) for m in r["mismatches"]] == [("2.weight", [1])] or r["step"] > 40
    assert "pinpoint" not in exact[0] and "first_diverged_step" not in exact[0]  # in sync: no such fields
    first = small_but_enough[3]
    assert (first["pinpoint"], first["first_diverged_step"], first["last_in_sync_step"]) == ("exact", 37, 36)
    bad = too_small[3]
    assert (bad["pinpoint"], bad["first_diverged_step"], bad["last_in_sync_step"]) == ("overflow", None, 30)
    assert any("ring overflowed" in n and "step 39" in n and "pinpoint_ring" in n for n in bad["notes"])
    assert AuditResult.from_dict(bad).pinpoint == "overflow"


def test_rings_that_tell_nothing_say_so_instead_of_guessing() -> None:
    def ring(pairs: list[tuple[int, int]], anchor: int | None = None, slices: int = 1) -> bytes:
        r = StepRing(8, slices)
        if anchor is not None:
            r.mark_in_sync(anchor)
        for s, d in pairs:
            r.record_digest(s, d)
        return r.encode()

    # Every recorded step agreed: the change came after step 3.
    p = locate([ring([(1, 1), (2, 2), (3, 3)]), ring([(1, 1), (2, 2), (3, 3)])])
    assert (p.state, p.first_diverged_step, p.last_in_sync_step) == ("unseen", None, 3)
    # The first recorded step already differs and nothing before it is known good.
    p = locate([ring([(1, 1), (2, 2)]), ring([(1, 9), (2, 9)])])
    assert (p.state, p.first_diverged_step) == ("earlier", None)
    # ... unless an in-sync audit at step 0 vouches for the step before it.
    p = locate([ring([(1, 1), (2, 2)], anchor=0), ring([(1, 9), (2, 9)], anchor=0)])
    assert (p.state, p.first_diverged_step, p.last_in_sync_step) == ("exact", 1, 0)
    # Sampled per-step digests: where it showed, never an in-sync claim.
    p = locate([ring([(1, 1), (2, 2)], slices=4), ring([(1, 1), (2, 9)], slices=4)])
    assert (p.state, p.first_diverged_step, p.last_in_sync_step) == ("sampled", 2, None)
    with pytest.raises(ValueError, match="pinpoint_ring"):
        StepRing(0)


def _gaps(rank: int, world: int, plant_bias: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(64, 8)
    if rank == 1:
        with torch.no_grad():
            model.weight.mul_(1 + 2e-7)
            if plant_bias:
                model.bias[3] += 0.01
    return _same_everywhere(audit(model, step=5, tolerance=1e-5).to_dict())


@pytest.mark.parametrize("plant_bias", [False, True], ids=["weight_drift_only", "drift_and_bias_jump"])
def test_tolerance_keeps_a_rounding_sized_gap_in_the_record_within_it_and_a_jump_beyond(plant_bias: bool) -> None:
    r0, r1 = run_ranks(_gaps, 2, plant_bias)
    assert r0 == r1
    by = {m["name"]: m for m in r0["mismatches"]}
    w = by["weight"]
    assert w["within_tolerance"] is True and 1e-7 < w["rel_diff"] < 5e-7, w
    assert r0["in_sync"] is False and r0["tolerance"] == 1e-5
    assert r0["hints"][0].startswith("weight differ by at most") and "numerical drift is likely" in r0["hints"][0]
    if plant_bias:
        b = by["bias"]
        assert b["within_tolerance"] is False and b["max_abs_diff"] == pytest.approx(0.01, rel=1e-4)
        assert b["rel_diff"] == pytest.approx(b["max_abs_diff"] / max(abs(x) for x in _bias()), rel=1e-6)
        assert r0["within_tolerance"] is False
        assert [m.name for m in AuditResult.from_dict(r0).beyond_tolerance] == ["bias"]
        assert len(r0["hints"]) == 2 and "bias" in r0["hints"][1]  # the jump gets the bug-class causes
    else:
        assert r0["within_tolerance"] is True and len(r0["hints"]) == 1


def _bias() -> list[float]:
    torch.manual_seed(0)
    return nn.Linear(64, 8).bias.tolist()


def test_without_pinpoint_a_divergent_record_says_pinpoint_off_and_readers_accept_old_records() -> None:
    r = AuditResult(in_sync=False, step=3, pinpoint="off", mismatches=[Mismatch("w", "param", [1], [0])])
    d = r.to_dict()
    assert d["pinpoint"] == "off" and d["first_diverged_step"] is None
    for key in ("pinpoint", "first_diverged_step"):
        del d[key]
    assert AuditResult.from_dict(d).pinpoint is None
    with pytest.raises(RuntimeError, match="pinpoint=True"):
        Auditor(nn.Linear(2, 2)).record_step(1)


def test_check_and_show_name_the_pinpointed_step_and_a_report_within_tolerance_passes_check(tmp_path: Path) -> None:
    from rich.console import Console

    from weightsync_audit import Mismatch
    from weightsync_audit.cli.reports import cmd_show
    from weightsync_audit.reporting.jsonl import ReportWriter
    from weightsync_audit.reporting.terminal import check_report

    drift = Mismatch("fc.weight", "param", [1], [0], [4], "float32", 2e-7, rel_diff=2e-7, within_tolerance=True)
    jump = Mismatch("fc.bias", "param", [1], [0], [4], "float32", 1e-2, rel_diff=3e-2, within_tolerance=False)
    runs = {
        "pinned": [
            AuditResult(in_sync=True, step=48, world_size=2),
            AuditResult(
                in_sync=False,
                step=64,
                world_size=2,
                mismatches=[jump],
                pinpoint="exact",
                first_diverged_step=49,
                last_in_sync_step=48,
            ),
        ],
        "tolerated": [AuditResult(in_sync=False, step=10, world_size=2, mismatches=[drift], tolerance=1e-5)],
    }
    out = {}
    for name, recs in runs.items():
        path = tmp_path / f"{name}.jsonl"
        with ReportWriter(path) as w:
            for r in recs:
                w.write(r)
        console = Console(record=True, width=200)
        code = check_report(str(path), console=console)
        plot = tmp_path / f"{name}.png"
        assert cmd_show(str(path), plot=str(plot), console=console) == 0 and plot.stat().st_size > 0
        out[name] = (code, console.export_text())
    code, text = out["pinned"]
    assert code == 1 and "began at step 49" in text and "in sync at step 48" in text
    code, text = out["tolerated"]
    assert code == 0 and "IN SYNC WITHIN TOLERANCE" in text and "within tolerance" in text
