"""An audit that compared nothing says so, in the record, in its summary line, in the run's summary and in
``check``, and never reads as "in sync", on real gloo ranks.

The truth is computed apart: what the audited module and optimizer hold (no parameter, no buffer, no
optimizer state) and, for a report that mixes both, which records compared tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import run_ranks
from torch import nn

from weightsync_audit import AuditResult, LoopAudit, audit
from weightsync_audit.cli import main


def _held(module: nn.Module, optimizer: Any = None) -> int:
    """How many tensors the module and the optimizer hold, counted without the library."""
    state = 0 if optimizer is None else sum(len(s) for s in optimizer.state.values())
    return sum(1 for _ in module.parameters()) + sum(1 for _ in module.buffers()) + state


def _empty_models(rank: int, world: int, report: str) -> dict[str, Any]:
    module = nn.Sequential(nn.ReLU(), nn.Flatten())  # layers, but no parameter and no buffer
    result = audit(module, step=1)
    with LoopAudit(module, every_n_steps=1, report_path=report, verbose=False) as loop:
        for step in (1, 2):
            loop.step(step)
    return {"held": _held(module), "record": result.to_dict(), "line": result.summary(), "run": loop.summary()}


def test_an_audit_of_a_model_with_nothing_to_compare_says_so_and_check_gives_no_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "audit.jsonl"
    out = run_ranks(_empty_models, 2, str(report))
    assert [o["held"] for o in out] == [0, 0]  # the truth: nothing to compare on any rank
    for o in out:
        record = o["record"]
        assert record["in_sync"] and record["world_size"] == 2 and sum(record["checked"].values()) == 0
        assert record["nothing_compared"] is True
        assert record["notes"][0].startswith("nothing was compared: no tensor to audit"), record["notes"]
        assert "in sync" not in o["line"] and "nothing was compared" in o["line"], o["line"]
        assert "in sync" not in o["run"] and "none compared a tensor" in o["run"], o["run"]
    assert main(["check", str(report)]) == 2
    text = capsys.readouterr().out
    assert "NOTHING COMPARED: none of the 2 audit(s)" in text and "IN SYNC" not in text, text
    assert main(["check", "--json", str(report)]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert (doc["status"], doc["nothing_compared_audits"]) == ("nothing_compared", 2)


def test_a_report_where_some_audits_compared_nothing_is_in_sync_only_for_those_that_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = nn.Linear(2, 2)
    real, empty = audit(model, step=1), audit(nn.ReLU(), step=2)
    assert _held(model) == 2 and _held(nn.ReLU()) == 0  # the truth
    assert not real.compared_nothing and empty.compared_nothing
    report = tmp_path / "audit.jsonl"
    report.write_text(json.dumps(real.to_dict()) + "\n" + json.dumps(empty.to_dict()) + "\n")
    assert main(["check", str(report)]) == 0
    text = capsys.readouterr().out
    assert "IN SYNC: all 1 audit(s) that compared tensors found every rank holding the same weights" in text
    assert "1 more compared nothing" in text and "note: nothing was compared: no tensor to audit" in text
    # The field round-trips; a divergent record cannot claim it.
    assert AuditResult.from_dict(empty.to_dict()).nothing_compared is True
    assert "nothing_compared" not in real.to_dict()
    bad = {**real.to_dict(), "in_sync": False, "nothing_compared": True}
    bad["mismatches"] = [{"name": "weight", "kind": "param", "ranks": [1], "reference_ranks": [0]}]
    with pytest.raises(ValueError, match="nothing_compared"):
        AuditResult.from_dict(bad)


def test_every_option_that_leaves_nothing_to_compare_is_said_per_kind() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _held(model, opt) == 2  # SGD without momentum keeps no state
    excluded = audit(model, opt, include=("params",), exclude=("*",))
    assert excluded.nothing_compared and "no parameter found" in excluded.notes[0]
    assert not audit(model, opt).nothing_compared  # the group's lr is compared
