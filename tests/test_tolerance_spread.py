"""What a tolerance may forgive, on real gloo ranks: floats drifting over many elements, nothing else.

Integers are exact (a step counter off by one is a bug), a localized difference is never drift however
small its gap (one row of an embedding, a handful of elements, a small tensor wholly different), and an
int64 gap is measured in integers (a difference of 1 above 2**53 stays 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import run_ranks
from torch import nn

from weightsync_audit import AuditResult, audit
from weightsync_audit.engine.measure.gaps import GapMeter


def _record(result: AuditResult) -> dict[str, Any]:
    return {k: v for k, v in result.to_dict().items() if k not in ("time", "duration_ms")}


def _drift_named(record: dict[str, Any], name: str) -> bool:
    """Some hint calls ``name`` numerical drift."""
    return any("numerical drift is likely" in h and h.split(" differ by")[0].count(name) for h in record["hints"])


def _integers(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    with torch.no_grad():
        for st in opt.state.values():
            st["step"].fill_(200000 + rank)  # Adam's step: a float32 scalar, 200000 vs 200001
        model[1].num_batches_tracked.fill_(7 + rank)  # int64
        model[0].weight.mul_(1 + 2e-7 * rank)  # real drift over every element, beside them
    return _record(audit(model, opt, step=3, tolerance=1e-4))


def test_integer_counters_and_a_step_off_by_one_are_never_within_tolerance_nor_hinted_as_drift() -> None:
    r0, r1 = run_ranks(_integers, 2)
    assert r0 == r1
    by = {m["name"]: m for m in r0["mismatches"]}
    nbt = by["1.num_batches_tracked"]
    assert (nbt["dtype"], nbt["max_abs_diff"], nbt["within_tolerance"], nbt["diff_count"]) == ("int64", 1.0, False, 1)
    steps = [m for n, m in by.items() if n.endswith(".step")]
    assert steps and all(m["within_tolerance"] is False and m["diff_count"] == 1 for m in steps), steps
    assert all(m["rel_diff"] < 1e-4 for m in steps)  # small relative gap, still not forgiven
    assert by["0.weight"]["within_tolerance"] is True and by["0.weight"]["diff_count"] > 2000
    assert r0["within_tolerance"] is False
    assert _drift_named(r0, "0.weight")
    for name in ["1.num_batches_tracked", *(n for n in by if n.endswith(".step"))]:
        assert not _drift_named(r0, name), (name, r0["hints"])


def _localized(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    emb = nn.Embedding(50_000, 64)
    fc = nn.Linear(64, 64)
    tiny = nn.Linear(64, 8)
    spread = nn.Linear(64, 64, bias=False)
    model = nn.ModuleDict({"emb": emb, "fc": fc, "tiny": tiny, "spread": spread})
    if rank == 1:
        with torch.no_grad():
            emb.weight[123] += 1e-4  # one unsynced row
            fc.weight.view(-1)[[5, 99, 1000, 2000, 4000]] *= 1 + 1e-6  # a handful of elements
            tiny.bias.mul_(1 + 2e-7)  # a small tensor, wholly different
            spread.weight.mul_(1 + 2e-7)  # drift: every element of a large tensor
    return _record(audit(model, step=9, tolerance=1e-4))


def test_a_localized_difference_is_never_drift_nor_within_tolerance_however_small_its_gap() -> None:
    r0, r1 = run_ranks(_localized, 2)
    assert r0 == r1
    by = {m["name"]: m for m in r0["mismatches"]}
    row = by["emb.weight"]
    assert row["diff_count"] == 64 and row["diff_share"] == pytest.approx(64 / (50_000 * 64))
    assert row["rel_diff"] < 1e-4 and row["within_tolerance"] is False
    assert by["fc.weight"]["diff_count"] == 5 and by["fc.weight"]["within_tolerance"] is False
    bias = by["tiny.bias"]
    assert bias["diff_share"] == 1.0 and bias["diff_count"] <= 8 and bias["within_tolerance"] is False
    assert by["spread.weight"]["within_tolerance"] is True and by["spread.weight"]["diff_share"] > 0.5
    assert r0["within_tolerance"] is False
    assert _drift_named(r0, "spread.weight")
    for name in ("emb.weight", "fc.weight", "tiny.bias"):
        assert not _drift_named(r0, name), (name, r0["hints"])
    back = AuditResult.from_dict(r0)
    assert {m.name: m.diff_count for m in back.mismatches}["emb.weight"] == 64


def _big_ints(rank: int, world: int) -> dict[str, Any]:
    model = nn.Module()
    model.register_buffer("counter", torch.tensor([2**53 + rank, 5], dtype=torch.int64))
    low, high = -(2**63), 2**63 - 1
    model.register_buffer("extremes", torch.tensor([low, high] if rank == 0 else [high, low], dtype=torch.int64))
    return _record(audit(model, step=1, tolerance=0.0))


def test_an_int64_gap_of_one_above_2_pow_53_is_measured_as_one_not_zero() -> None:
    r0, r1 = run_ranks(_big_ints, 2)
    assert r0 == r1
    by = {m["name"]: m for m in r0["mismatches"]}
    c = by["counter"]
    assert (c["max_abs_diff"], c["diff_count"], c["within_tolerance"]) == (1.0, 1, False)
    e = by["extremes"]  # a gap of 2**64 - 1 does not wrap to a small number
    assert e["max_abs_diff"] == pytest.approx(2.0**64) and e["diff_count"] == 2
    meter = GapMeter()
    meter.update(torch.tensor([2**62 + 1, 3], dtype=torch.int64), torch.tensor([2**62, 3], dtype=torch.int64))
    assert (meter.max_abs_diff, meter.diff_count) == (1.0, 1)
    meter = GapMeter()
    meter.update(torch.tensor([float("nan"), 1.0, -0.0]), torch.tensor([float("nan"), 1.5, 0.0]))
    assert (meter.max_abs_diff, meter.diff_count) == (0.5, 1)


def _contradictions() -> list[tuple[dict[str, Any], str]]:
    from records import CONTRACT_EXAMPLE

    base = {**CONTRACT_EXAMPLE, "mismatches": [dict(CONTRACT_EXAMPLE["mismatches"][0])]}
    m = base["mismatches"][0]
    structure = {**m, "kind": "structure", "rel_diff": 0.9, "within_tolerance": True}
    return [
        ({**base, "mismatches": [structure]}, "a structure mismatch"),
        ({**base, "mismatches": [{**m, "rel_diff": 0.9, "within_tolerance": True}]}, "no 'tolerance'"),
        ({**base, "tolerance": 1e-5, "mismatches": [{**m, "rel_diff": 0.9, "within_tolerance": True}]}, "exceeds"),
        ({**base, "tolerance": 1e-5, "mismatches": [{**m, "within_tolerance": True}]}, "not measured"),
        ({**base, "tolerance": 1e-5, "within_tolerance": True}, "some mismatch"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_a_contradictory_within_tolerance_is_refused_naming_the_line_and_check_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: int
) -> None:
    from weightsync_audit.cli import main
    from weightsync_audit.errors import ReportFormatError

    record, why = _contradictions()[case]
    with pytest.raises(ReportFormatError, match="within_tolerance") as exc:
        AuditResult.from_dict(record)
    assert why in str(exc.value)
    ok = {**record, "in_sync": True, "mismatches": [], "within_tolerance": None, "step": 48}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(ok) + "\n" + json.dumps(record) + "\n")
    assert main(["check", str(path)]) == 2
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert "line 2" in text and "within_tolerance" in text, text
    consistent = {**record["mismatches"][0], "kind": "param", "rel_diff": 1e-6, "within_tolerance": True}
    fine = {**record, "tolerance": 1e-5, "mismatches": [consistent], "within_tolerance": True}
    assert AuditResult.from_dict(fine).within_tolerance is True
