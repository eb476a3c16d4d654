"""What ``summary()`` says in a process that ran no audit itself: the parent of ``ddp_spawn`` /
``ddp_fork`` workers (or any launcher that starts the ranks as child processes).

The callback object the user holds in the parent is not the one that audited: each worker has its own
copy, and its history ends with the worker. So global rank 0 hands its history back through a small file
named when the callback was built (:class:`HistoryHandoff`, in the temp folder, removed when read or when
the parent exits); failing that, the parent reads the report file back; failing that, it says plainly
where the audits ran, never "in sync throughout" for a run it did not see.
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from weightsync_audit.reporting.jsonl import read_report
from weightsync_audit.text import brief_names, last_in_sync

__all__ = ["HistoryHandoff", "summary_outside_workers"]


class HistoryHandoff:
    """A file through which a worker's audit history reaches the process that built the callback.

    >>> h = HistoryHandoff()
    >>> h.put({"audits": 3}, force=True)   # a worker process writes without force
    >>> h.take()
    {'audits': 3}
    >>> h.take() is None
    True
    """

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.path = Path(tempfile.gettempdir()) / f"weightsync-audit-history-{self.owner}-{uuid.uuid4().hex}.json"
        atexit.register(self._cleanup)

    def put(self, state: dict[str, Any], *, force: bool = False) -> None:
        """Leave ``state`` for the owner when this is another process (atomically; a failure to write
        only costs the hand-off). In the owner itself the history is already at hand: nothing is written."""
        if os.getpid() == self.owner and not force:
            return
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path)
        except (OSError, TypeError, ValueError):
            tmp.unlink(missing_ok=True)

    def take(self) -> dict[str, Any] | None:
        """The state a worker left, once (in the owner process only), or ``None``."""
        if os.getpid() != self.owner:
            return None
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        self.path.unlink(missing_ok=True)
        return state if isinstance(state, dict) else None

    def _cleanup(self) -> None:
        if os.getpid() == self.owner:
            self.path.unlink(missing_ok=True)


def summary_outside_workers(report_path: str | None) -> str:
    """The run's summary as read from ``report_path``, or a plain statement that this process saw no audit.

    >>> summary_outside_workers(None)[:56]
    'weightsync audit: no audit ran in this process (under dd'
    """
    where = (
        "no audit ran in this process (under ddp_spawn, ddp_fork and other launchers that start the ranks "
        "as child processes the audits run in the workers, and their history ends with them)"
    )
    if report_path is None:
        return (
            f"weightsync audit: {where}; pass report_path=... to keep the run's record and read it here, or see "
            "the report printed by rank 0 during fit"
        )
    if not os.path.isfile(report_path):
        return f"weightsync audit: {where}; the report {report_path} does not exist (the run did not audit?)"
    try:
        contents = read_report(report_path)
    except OSError as exc:
        return f"weightsync audit: {where}; the report {report_path} cannot be read ({exc})"
    rs = [r for _, r in contents.records]
    if not rs:
        return f"weightsync audit: {where}; the report {report_path} holds no valid record"
    diverged = [r for r in rs if not r.in_sync]
    source = f"read back from {report_path} (the audits ran in the worker processes)"
    if not diverged:
        return (
            f"weightsync audit: {len(rs)} audit(s), replicas in sync throughout, last at step {rs[-1].step}; {source}"
        )
    first = diverged[0]
    ordered = sorted(first.mismatches, key=lambda m: m.kind != "param")
    end = "in sync" if rs[-1].in_sync else "diverged"
    return (
        f"weightsync audit: {len(rs)} audit(s), {len(diverged)} found divergence; first at step {first.step} "
        f"({brief_names((m.name for m in ordered), 5)}); {last_in_sync(first.step, first.last_in_sync_step)}; "
        f"{sum(r.action == 'resynced' for r in rs)} resync(s); {end} at the end; {source}"
    )
