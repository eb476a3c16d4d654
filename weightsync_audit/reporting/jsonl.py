"""Where records go: an append-only JSONL report, one record a line, each flushed and fsynced.

Writing: a record is one ``write`` of one line followed by ``flush`` and ``fsync``, so a crash loses at
most the record being written, never an earlier one. A resumed run appends to the same file; if the
file ends in a torn line (a crash mid-write), a newline is written first so the torn line stays alone
and every later record stays readable.

Reading: :func:`read_report` parses every line and never evaluates content (``json.loads`` only). A
line that is not a valid record is reported with its number and why; a torn last line is said to be
torn.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from weightsync_audit.errors import ReportFormatError
from weightsync_audit.reporting.record import AuditResult

__all__ = ["ReportWriter", "ReportContents", "read_report", "check_report_path"]


def check_report_path(path: str | os.PathLike[str], argument: str = "report_path") -> Path:
    """Fail now, naming ``argument``, when ``path`` cannot be appended to."""
    p = Path(path)
    if p.exists() and p.is_dir():
        raise ValueError(f"{argument}={str(path)!r} is a directory; give a file path such as audit.jsonl")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise ValueError(f"{argument}={str(path)!r}: the directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise ValueError(f"{argument}={str(path)!r}: {str(parent)!r} is a file, not a directory")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{argument}={str(path)!r} is not writable")
    if not p.exists() and not os.access(parent, os.W_OK):
        raise ValueError(f"{argument}={str(path)!r}: the directory {str(parent)!r} is not writable")
    return p


class ReportWriter:
    """Append records to a JSONL file; each record is durable before ``write`` returns.

    >>> import tempfile, os
    >>> from weightsync_audit import AuditResult
    >>> path = os.path.join(tempfile.mkdtemp(), "audit.jsonl")
    >>> with ReportWriter(path) as w:
    ...     w.write(AuditResult(in_sync=True, step=1))
    >>> len(read_report(path).records)
    1
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = check_report_path(path)
        self.fsync = fsync
        self._file: Any = None

    def _open(self) -> Any:
        if self._file is None:
            f = open(self.path, "ab")
            if f.tell() > 0:
                with open(self.path, "rb") as r:
                    r.seek(-1, os.SEEK_END)
                    if r.read(1) != b"\n":
                        f.write(b"\n")  # isolate a torn line left by a crash
            self._file = f
        return self._file

    def write(self, record: AuditResult | Mapping[str, Any]) -> None:
        d = record.to_dict() if isinstance(record, AuditResult) else dict(record)
        line = json.dumps(d, ensure_ascii=True, allow_nan=False, separators=(",", ":")) + "\n"
        f = self._open()
        f.write(line.encode("ascii"))
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> ReportWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(slots=True)
class ReportContents:
    """Every valid record of a report, and every line that was not one."""

    records: list[tuple[int, AuditResult]] = field(default_factory=list)
    """(line number, record) for each valid line."""
    errors: list[ReportFormatError] = field(default_factory=list)
    """One error per invalid line; ``.line`` is its number and ``.torn`` says it was cut short."""

    @property
    def torn_last_line(self) -> bool:
        return bool(self.errors) and self.errors[-1].torn


def read_report(path: str | os.PathLike[str]) -> ReportContents:
    """Parse a JSONL report. Raises ``OSError`` when the file cannot be read at all."""
    data = Path(path).read_bytes()
    out = ReportContents()
    lines = data.split(b"\n")
    ends_clean = data.endswith(b"\n") or not data
    if lines and lines[-1] == b"":
        lines.pop()
    for i, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        last = i == len(lines)
        torn = last and not ends_clean
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            out.errors.append(ReportFormatError(f"line {i}: not UTF-8 text ({exc.reason})", i, torn))
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            why = (
                "torn (cut short, most likely by a crash while writing)"
                if torn
                else f"not JSON ({exc.msg} at column {exc.colno})"
            )
            out.errors.append(ReportFormatError(f"line {i}: {why}", i, torn))
            continue
        try:
            out.records.append((i, AuditResult.from_dict(obj)))
        except ReportFormatError as exc:
            out.errors.append(ReportFormatError(f"line {i}: not a valid record: {exc}", i, False))
    return out
