"""``check --accept-repaired`` on real resync runs (issue 42, item 15): a cause that comes back after its repair
is not repaired (exit 1, said), while distinct faults each repaired once still are (exit 0). The truth is the
test's own: every rank's weights gathered after each planted fault and after each audit, compared with
``torch.equal``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from weightsync_audit import LoopAudit
from weightsync_audit.cli import main


def _equal_everywhere(model: torch.nn.Module) -> bool:
    """Whether every rank holds the same bytes, gathered here (independently of the library)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(got, flat)
    return all(torch.equal(got[0], g) for g in got)


def _run(rank: int, world: int, report: str, faults: dict[int, tuple[int, str]]) -> list[dict[str, Any]]:
    """Steps 1-6 with an audit each; ``faults``: step -> (rank, parameter) that rank corrupts before it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    audit = LoopAudit(model, on_mismatch="resync", report_path=report, verbose=False)
    truth = []
    for step in range(1, 7):
        if step in faults and faults[step][0] == rank:
            with torch.no_grad():
                dict(model.named_parameters())[faults[step][1]].view(-1)[0] += 0.5
        before = _equal_everywhere(model)
        result = audit.audit(step)
        assert result is not None
        truth.append({"step": step, "diverged": not before, "after": _equal_everywhere(model), "action": result.action})
    audit.close()
    return truth


def _check(capsys: pytest.CaptureFixture[str], report: Path) -> tuple[int, str, dict[str, Any]]:
    code = main(["check", str(report), "--accept-repaired"])
    text = capsys.readouterr().out
    assert main(["check", str(report), "--accept-repaired", "--json"]) == code
    return code, text, json.loads(capsys.readouterr().out)


def test_the_same_rank_diverging_again_after_its_resync_is_not_repaired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "again.jsonl"
    truth = run_ranks(_run, 2, str(report), {2: (1, "0.weight"), 4: (1, "0.weight")})[0]
    diverged = [t["step"] for t in truth if t["diverged"]]
    assert diverged == [2, 4] and all(t["after"] for t in truth)  # repaired each time, and back again
    assert [t["action"] for t in truth if t["diverged"]] == ["resynced", "resynced"]
    code, text, doc = _check(capsys, report)
    assert code == 1 and doc["status"] == "diverged" and doc["repaired"] is False
    assert "NOT REPAIRED: a cause came back after its repair, 1 time(s); first at step 4: rank 1 (0.weight)" in text
    assert "diverged again after the resync at step 2 repaired it" in text and "REPAIRED:" not in text.split("NOT")[0]
    assert doc["recurred"] == [{"line": 4, "step": 4, "ranks": [1], "names": ["0.weight"], "resynced_step": 2}]


def test_distinct_faults_each_repaired_once_are_repaired(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "distinct.jsonl"
    truth = run_ranks(_run, 4, str(report), {2: (2, "0.weight"), 4: (3, "1.bias")})[0]
    assert [t["step"] for t in truth if t["diverged"]] == [2, 4] and all(t["after"] for t in truth)
    code, text, doc = _check(capsys, report)
    assert code == 0 and doc["status"] == "repaired" and doc["recurred"] == []
    assert "REPAIRED: 2 of 6 audit(s)" in text and "NOT REPAIRED" not in text
