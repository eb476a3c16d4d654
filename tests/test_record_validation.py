"""One strict validation of a record (issue 11, point 6): every malformed field is exit 2 with a message
naming the line and the field, never a traceback, for ``check``, ``show`` and ``from_dict``; torn lines
are named and skipped anywhere; ``diff`` refuses FIFOs and stride tricks."""

from __future__ import annotations

import copy
import json
import math
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from records import CONTRACT_EXAMPLE

from weightsync_audit import AuditResult
from weightsync_audit.cli import main
from weightsync_audit.errors import ReportFormatError
from weightsync_audit.reporting.jsonl import read_report
from weightsync_audit.reporting.render import render_group

VALID: dict[str, Any] = copy.deepcopy(CONTRACT_EXAMPLE)
IN_SYNC = {**VALID, "in_sync": True, "mismatches": [], "hints": [], "step": 48}


def _set(path: str, value: Any) -> dict[str, Any]:
    rec = copy.deepcopy(VALID)
    target, key = rec, path
    if path.startswith("m."):
        target, key = rec["mismatches"][0], path[2:]
    elif "." in path:
        head, key = path.split(".", 1)
        target = rec[head]
    target[key] = value
    return rec


CASES = [
    (json.dumps(_set("m.detail", 5)), "mismatches[0].detail"),
    (json.dumps(_set("checked.param", "x")), "checked.param"),
    (json.dumps(_set("checked.param", None)), "checked.param"),
    (json.dumps(_set("checked.param", 1)).replace('"param": 1', '"param": 1e400'), "checked.param"),
    (json.dumps(_set("notes", "abc")), "notes"),
    (json.dumps(_set("notes", 5)), "notes"),
    (json.dumps(_set("hints", [1, None])), "hints"),
    (json.dumps(_set("m.shape", [True, False])), "mismatches[0].shape"),
    (json.dumps(_set("m.max_abs_diff", 1.0)).replace('"max_abs_diff": 1.0', '"max_abs_diff": NaN'), "max_abs_diff"),
    (json.dumps(_set("step", 1)).replace('"step": 1,', '"step": ' + "7" * 5000 + ","), "step"),
    ('{"schema": "weightsync-audit/1", "detail": ' + "[" * 200_000 + "]" * 200_000 + "}", "detail"),
    (json.dumps({**VALID, "mismatches": []}), "in_sync"),
    (json.dumps(_set("world_size", 0)), "world_size"),
    (json.dumps(_set("m.ranks", [-1])), "mismatches[0].ranks"),
    (json.dumps(_set("coverage", "9/8")), "coverage"),
]


@pytest.mark.parametrize("line,field", CASES, ids=[c[1] + str(i) for i, c in enumerate(CASES)])
@pytest.mark.parametrize("cmd", ["check", "show"])
def test_a_malformed_field_is_exit_2_naming_the_line_and_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, line: str, field: str, cmd: str
) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(IN_SYNC) + "\n" + line + "\n")
    assert main([cmd, str(path)]) == 2
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert "line 2" in text and field in text, text
    assert "Traceback" not in text


def test_from_dict_names_the_field_for_every_case() -> None:
    for line, field in CASES:
        from weightsync_audit.reporting.json_line import loads_record

        try:
            obj = loads_record(line)
        except ReportFormatError as exc:
            assert field in str(exc)
            continue
        with pytest.raises(ReportFormatError, match=field.replace("[", r"\[").replace("]", r"\]")):
            AuditResult.from_dict(obj)


def test_unknown_fields_are_accepted_for_forward_compatibility() -> None:
    rec = {**VALID, "first_diverged_step": 47, "future": {"x": [1]}}
    rec["mismatches"] = [{**VALID["mismatches"][0], "shard": {"dp": 0}, "rel_diff": 0.1, "within_tolerance": False}]
    assert AuditResult.from_dict(rec).mismatches[0].name == "backbone.weight"


def test_a_torn_line_before_a_resumed_runs_records_is_named_and_skipped_with_allow_torn(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "a.jsonl"
    torn = json.dumps(IN_SYNC)[:40]
    path.write_text(json.dumps(IN_SYNC) + "\n" + torn + "\n" + json.dumps({**IN_SYNC, "step": 60}) + "\n")
    assert main(["check", str(path)]) == 2
    assert "line 2: torn" in capsys.readouterr().out
    assert main(["check", str(path), "--allow-torn"]) == 0
    out = capsys.readouterr().out
    assert "warning" in out and "line 2: torn" in out and "later records follow" in out


def _run_with_deadline(argv: list[str], seconds: float) -> int | None:
    box: list[int] = []
    t = threading.Thread(target=lambda: box.append(main(argv)), daemon=True)
    t.start()
    t.join(seconds)
    return box[0] if box else None


def test_diff_refuses_a_fifo_instead_of_waiting_on_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    good = tmp_path / "good.pt"
    torch.save({"w": torch.zeros(2)}, good)
    assert _run_with_deadline(["diff", str(fifo), str(good)], 20) == 2
    assert "not a regular file" in capsys.readouterr().err


def test_diff_refuses_a_stride_zero_tensor_that_would_expand_past_the_limit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"w": torch.zeros(1).expand(2**28)}, a)
    torch.save({"w": torch.ones(1).expand(2**28)}, b)
    assert a.stat().st_size < 4096
    assert main(["diff", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "'w'" in err and "268435456 elements" in err and "refused" in err


# -- property: any JSON value in any field ----------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
FIELDS = [*(k for k in VALID if k != "mismatches"), "mismatches", "notes", "coverage", "last_full_sync_step"]
FIELDS += [f"m.{k}" for k in VALID["mismatches"][0]]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=json_values, base=st.sampled_from(["diverged", "in_sync"]))
def test_any_json_value_in_any_field_is_a_valid_record_or_a_named_error(
    tmp_path: Path, field: str, value: Any, base: str
) -> None:
    rec = _set(field, value) if base == "diverged" or field.startswith("m.") else {**IN_SYNC, field: value}
    line = json.dumps(rec, allow_nan=True)
    try:
        r = AuditResult.from_dict(json.loads(line))
    except ReportFormatError as exc:
        assert field.removeprefix("m.").split(".")[0] in str(exc) or "in_sync" in str(exc), (field, str(exc))
    else:
        again = AuditResult.from_dict(r.to_dict())  # what was accepted writes a valid record back
        assert again.to_dict() == r.to_dict()
        assert all(math.isfinite(m.max_abs_diff) for m in r.mismatches if m.max_abs_diff is not None)
        list(render_group(r).renderables)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(IN_SYNC) + "\n" + line + "\n")
    contents = read_report(path)  # never raises: a record, or an error naming line 2
    assert len(contents.records) + len(contents.errors) == 2
    assert all(e.line == 2 and "line 2" in str(e) for e in contents.errors)
