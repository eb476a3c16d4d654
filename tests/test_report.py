"""The JSONL report: appended, one durable record a line, torn lines isolated and named."""

from __future__ import annotations

from pathlib import Path

from weightsync_audit import AuditResult, Mismatch
from weightsync_audit.reporting.jsonl import ReportWriter, read_report


def test_records_are_appended_and_readable_after_each_write(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    w = ReportWriter(path)
    for step in range(3):
        w.write(AuditResult(in_sync=True, step=step))
        # visible to a reader before close: flushed per record
        assert [r.step for _, r in read_report(path).records] == list(range(step + 1))
    w.close()
    with ReportWriter(path) as w2:  # a resumed run appends to the same file
        w2.write(AuditResult(in_sync=True, step=3))
    assert [r.step for _, r in read_report(path).records] == [0, 1, 2, 3]


def test_a_torn_last_line_is_reported_as_torn_and_earlier_records_survive(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    with ReportWriter(path) as w:
        w.write(AuditResult(in_sync=True, step=1))
        w.write(AuditResult(in_sync=True, step=2))
    with open(path, "ab") as f:
        f.write(b'{"schema":"weightsync-audit/1","time":"2026-')  # a crash mid-write
    contents = read_report(path)
    assert [r.step for _, r in contents.records] == [1, 2]
    assert contents.torn_last_line and contents.errors[0].line == 3 and "torn" in str(contents.errors[0])


def test_a_resumed_run_after_a_crash_keeps_the_torn_line_apart(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"schema":"weightsync-audit/1"')  # only a torn line
    with ReportWriter(path) as w:
        w.write(AuditResult(in_sync=False, step=9, mismatches=[Mismatch("w", "param", [1], [0])]))
    contents = read_report(path)
    assert [r.step for _, r in contents.records] == [9]
    assert [e.line for e in contents.errors] == [1] and not contents.torn_last_line
    assert contents.errors[0].torn, "a torn line before a resumed run's records is still named torn"


def test_an_invalid_line_in_the_middle_is_named_with_its_number_and_reason(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    with ReportWriter(path) as w:
        w.write(AuditResult(in_sync=True, step=1))
    with open(path, "ab") as f:
        f.write(b'{"schema": "weightsync-audit/1", "in_sync": 3}\n')
        f.write(b"not json\n")
    errors = read_report(path).errors
    assert [e.line for e in errors] == [2, 3]
    assert "in_sync" in str(errors[0]) or "lacks" in str(errors[0])
    assert "not JSON" in str(errors[1])


def test_odd_names_survive_the_round_trip(tmp_path: Path) -> None:
    from weightsync_audit import Mismatch

    name = 'layer"\n\\ü.权重\u2028'
    path = tmp_path / "a.jsonl"
    with ReportWriter(path) as w:
        w.write(AuditResult(in_sync=False, mismatches=[Mismatch(name, "param", [1], [0])]))
    assert path.read_bytes().count(b"\n") == 1
    [(_, r)] = read_report(path).records
    assert r.mismatches[0].name == name
