"""The report record: exactly the contract's shape, round-trips, validation that names the field."""

from __future__ import annotations

import io
import json

import pytest
from records import CONTRACT_EXAMPLE
from rich.console import Console

from weightsync_audit import AuditResult, Mismatch, ReportFormatError


def test_the_contract_example_round_trips_exactly() -> None:
    r = AuditResult.from_dict(CONTRACT_EXAMPLE)
    assert r.to_dict() == CONTRACT_EXAMPLE
    assert r.mismatches[0].ranks == [1] and r.last_in_sync_step == 48


def test_to_dict_has_exactly_the_contract_keys_in_order() -> None:
    d = AuditResult(in_sync=True, step=1).to_dict()
    assert list(d) == list(CONTRACT_EXAMPLE)
    assert list(Mismatch("a", "param", [1], [0]).to_dict()) == list(CONTRACT_EXAMPLE["mismatches"][0])


def test_non_finite_gaps_are_written_as_null_so_the_record_stays_valid_json() -> None:
    m = Mismatch("a", "param", [1], [0], max_abs_diff=float("inf"))
    d = AuditResult(in_sync=False, mismatches=[m]).to_dict()
    assert d["mismatches"][0]["max_abs_diff"] is None
    json.dumps(d, allow_nan=False)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"schema": "weightsync-audit/0"}, "schema"),
        ({"in_sync": "no"}, "in_sync"),
        ({"step": "49"}, "step"),
        ({"action": "ignored"}, "action"),
        ({"mismatches": [{"name": "a", "kind": "weird", "ranks": [1], "reference_ranks": [0]}]}, "kind"),
        ({"mismatches": [{"name": "a", "kind": "param", "ranks": ["1"], "reference_ranks": [0]}]}, "ranks"),
        ({"in_sync": True}, "in_sync is true but mismatches"),
    ],
)
def test_invalid_records_are_refused_naming_what_is_wrong(change: dict, message: str) -> None:
    with pytest.raises(ReportFormatError, match=message):
        AuditResult.from_dict({**CONTRACT_EXAMPLE, **change})


def test_a_missing_field_is_named() -> None:
    d = dict(CONTRACT_EXAMPLE)
    del d["world_size"]
    with pytest.raises(ReportFormatError, match="world_size"):
        AuditResult.from_dict(d)


def test_the_result_renders_itself_as_a_table_grouped_by_layer() -> None:
    r = AuditResult.from_dict(
        {
            **CONTRACT_EXAMPLE,
            "mismatches": [
                {**CONTRACT_EXAMPLE["mismatches"][0]},
                {**CONTRACT_EXAMPLE["mismatches"][0], "name": "backbone.bias", "shape": [16]},
                {**CONTRACT_EXAMPLE["mismatches"][0], "name": "backbone.weight.momentum_buffer", "kind": "optimizer"},
            ],
        }
    )
    buf = io.StringIO()
    Console(file=buf, width=140).print(r)
    out = buf.getvalue()
    assert "DIVERGED, 3 of 6 tensors differ on rank(s) [1]" in out
    assert out.count("backbone") >= 1 and "momentum_buffer" in out and "16x32" in out and "0.0031" in out
    assert "last in sync at step 48" in out and "hint: backbone.weight" in out
    # grouped: the layer name is printed once for its three rows
    assert sum(1 for line in out.splitlines() if line.strip("│ ").startswith("backbone ")) == 1


def test_in_sync_result_renders_one_line() -> None:
    buf = io.StringIO()
    Console(file=buf, width=120).print(AuditResult(in_sync=True, step=3, world_size=4, checked={"param": 2}))
    assert buf.getvalue().strip() == "weightsync audit: step 3: in sync across 4 rank(s), 2 tensors checked"
