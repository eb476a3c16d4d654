"""Where records go: an append-only JSONL report, one record a line, each flushed and fsynced.

Writing: a record is one line appended with ``os.write`` and followed by ``fsync``, so a crash loses
at most the record being written, never an earlier one. A write that fails (a full disk) can keep the
record for the next write instead of raising (``keep_on_error``). A resumed run appends to the same file; if the
file ends in a torn line (a crash mid-write), a newline is written first so the torn line stays alone
and every later record stays readable.

Reading: :func:`read_report` parses every line and never evaluates content (``json.loads`` only). A
line that is not a valid record is reported with its number and the field that is wrong
(:mod:`~weightsync_audit.reporting.validate`); no line, however malformed, escapes as another error. A
torn line (a record cut short by a crash: an object or string left open) is said to be torn wherever it
is, including before the records of a resumed run.

Elsewhere: a record sink (``sinks=[...]`` of the callbacks, :class:`~weightsync_audit.LoopAudit` and the
runner) is any object with a ``write(record)`` method, the metrics exporters among them. Sinks get each record
on the main process only, right after the report, before any raise or exit; a failing sink never ends the
run: its first failure warns (:class:`~weightsync_audit.WeightSyncWarning`), the next record is offered again.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from weightsync_audit.errors import ReportFormatError, warn_user
from weightsync_audit.reporting.json_line import json_skeleton, loads_record
from weightsync_audit.reporting.record import AuditResult

__all__ = ["ReportWriter", "ReportContents", "RecordSink", "RecordSinks", "read_report", "check_report_path"]


def check_report_path(path: str | os.PathLike[str], argument: str = "report_path") -> Path:
    """Fail now, naming ``argument``, when ``path`` cannot be appended to."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise TypeError(f"{argument}={path!r}: give a file path (str or pathlib.Path) such as 'audit.jsonl'")
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


class ReportWriter(contextlib.AbstractContextManager["ReportWriter"]):
    """Append records to a JSONL file; each record is durable before ``write`` returns.

    With ``keep_on_error=True`` (what the callbacks use) a write that fails (a full disk, a removed
    directory) does not raise: it warns once (:class:`~weightsync_audit.WeightSyncWarning`) and keeps
    the record in memory; every later ``write`` (and ``close``) first retries the kept ones, in order,
    so they return to the file once space does. A failed write leaves no torn line: the file is cut
    back to where the record began. At most ``max_kept`` records are kept (the oldest go first, and the
    next successful write says how many were lost).

    >>> import tempfile, os
    >>> from weightsync_audit import AuditResult
    >>> path = os.path.join(tempfile.mkdtemp(), "audit.jsonl")
    >>> with ReportWriter(path) as w:
    ...     w.write(AuditResult(in_sync=True, step=1))
    >>> len(read_report(path).records)
    1
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool = True,
        keep_on_error: bool = False,
        max_kept: int = 10_000,
    ) -> None:
        self.path = check_report_path(path)
        self.fsync = fsync
        self.keep_on_error = keep_on_error
        self.max_kept = max_kept
        self._fd: int | None = None
        self._kept: deque[bytes] = deque()
        self._lost = 0
        self._failing = False

    @property
    def kept(self) -> int:
        """Records waiting in memory for the file to be writable again."""
        return len(self._kept)

    def _open(self) -> int:
        if self._fd is None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size > 0:
                    with open(self.path, "rb") as r:
                        r.seek(-1, os.SEEK_END)
                        if r.read(1) != b"\n":
                            self._write_line(fd, b"\n")  # isolate a torn line left by a crash
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
        return self._fd

    def _write_line(self, fd: int, data: bytes) -> None:
        """Write all of ``data`` at the end of the file (the one place bytes reach the disk)."""
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    def _append(self, line: bytes) -> None:
        fd = self._open()
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            self._write_line(fd, line)
            if self.fsync:
                os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, start)  # no torn line: cut back to where this record began
            except OSError:
                pass
            self._close_fd()
            raise

    def _drain(self) -> None:
        while self._kept:
            try:
                self._append(self._kept[0])
            except OSError as exc:
                if not self.keep_on_error:
                    self._kept.clear()
                    raise
                if not self._failing:
                    self._failing = True
                    warn_user(
                        f"weightsync audit: cannot write the report {str(self.path)!r} ({exc.strerror or exc}); "
                        f"keeping the record(s) in memory and writing them once it is writable again"
                    )
                return
            self._kept.popleft()
        if self._failing:
            self._failing = False
            lost = f"; {self._lost} older record(s) were dropped" if self._lost else ""
            warn_user(
                f"weightsync audit: the report {str(self.path)!r} is writable again; the kept records are in it{lost}"
            )
            self._lost = 0

    def write(self, record: AuditResult | Mapping[str, Any]) -> None:
        d = record.to_dict() if isinstance(record, AuditResult) else dict(record)
        line = json.dumps(d, ensure_ascii=True, allow_nan=False, separators=(",", ":")) + "\n"
        self._kept.append(line.encode("ascii"))
        while len(self._kept) > self.max_kept:
            self._kept.popleft()
            self._lost += 1
        self._drain()

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def close(self) -> None:
        """Write what is kept (when possible) and close the file."""
        if self._kept:
            self._drain()
            if self._kept:
                warn_user(f"weightsync audit: {len(self._kept)} record(s) could not be written to {str(self.path)!r}")
        self._close_fd()

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
        """The file ends in a torn line (no record after it)."""
        if not self.errors or not self.errors[-1].torn:
            return False
        return not self.records or self.records[-1][0] < (self.errors[-1].line or 0)


def cut_short(text: str) -> bool:
    """Whether ``text`` reads as the start of a JSON object cut off mid-way (a string or bracket left open).

    >>> cut_short('{"schema":"weightsync-audit/1","step":4,"mism'), cut_short('{"a": 1}}')
    (True, False)
    """
    stripped = text.strip()
    if not stripped.startswith("{"):
        return False
    depth, quotes = 0, 0
    for _, ch in json_skeleton(stripped):
        if ch == '"':
            quotes += 1
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return False  # closed (or over-closed) before the end: corrupt, not cut short
    return quotes % 2 == 1 or depth > 0


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
            obj = loads_record(text)
        except ReportFormatError as exc:
            out.errors.append(ReportFormatError(f"line {i}: not a valid record: {exc}", i, False))
            continue
        except json.JSONDecodeError as exc:
            torn = torn or cut_short(text)
            later = "" if last else "; later records follow (the run resumed)"
            why = (
                f"torn (cut short, most likely by a crash while writing{later})"
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


@runtime_checkable
class RecordSink(Protocol):
    """Anything that takes the audit records: ``write(record)`` on the main process, once per audit."""

    def write(self, record: AuditResult) -> None: ...


class RecordSinks:
    """The sinks of one runner, each record offered to each in order; a failing sink warns once and is kept.

    >>> class Count:
    ...     n = 0
    ...     def write(self, record): self.n += 1
    >>> c = Count()
    >>> RecordSinks([c]).write(AuditResult(in_sync=True))
    >>> c.n
    1
    >>> RecordSinks([print])
    Traceback (most recent call last):
    ValueError: sinks[0]=<built-in function print>: a record sink needs a write(record) method (e.g. weightsync_audit.metrics.PrometheusSink)
    """

    def __init__(self, sinks: Sequence[RecordSink] = ()) -> None:
        if isinstance(sinks, RecordSink):
            sinks = [sinks]
        try:
            if isinstance(sinks, (str, bytes)):
                raise TypeError(sinks)
            self.sinks: tuple[RecordSink, ...] = tuple(sinks)
        except TypeError:
            raise ValueError(
                f"sinks={sinks!r}: give a list of sink objects (e.g. [PrometheusSink(port=9400)])"
            ) from None
        for i, sink in enumerate(self.sinks):
            if not callable(getattr(sink, "write", None)):
                raise ValueError(
                    f"sinks[{i}]={sink!r}: a record sink needs a write(record) method "
                    "(e.g. weightsync_audit.metrics.PrometheusSink)"
                )
        self._failing: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def write(self, record: AuditResult) -> None:
        """Offer ``record`` to every sink; a sink's error is a warning (once per sink until it works again)."""
        for i, sink in enumerate(self.sinks):
            try:
                sink.write(record)
            except Exception as exc:  # noqa: BLE001 - an exporter never ends the user's training
                if i not in self._failing:
                    self._failing.add(i)
                    warn_user(
                        f"weightsync audit: the record sink {type(sink).__name__} failed on the record of step "
                        f"{record.step} ({type(exc).__name__}: {exc}); training goes on and the next record is "
                        "offered to it again"
                    )
            else:
                self._failing.discard(i)
