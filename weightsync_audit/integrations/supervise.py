"""Run a launcher (torchrun, srun, a script) to its end, and take every process it started down with it when
the wrapper itself is told to stop: what ``weightsync-audit launch`` runs its command with.

- The command runs in a process group of its own, so a terminal's Ctrl-C or a scheduler's signal reaches it
  once, through the wrapper, never twice (torchrun's shutdown is interrupted by a second signal).
- Every terminating signal the wrapper gets (``SIGINT``, ``SIGTERM``, ``SIGHUP``, ``SIGQUIT``) is forwarded to
  that group; the wrapper then waits for the command. torchrun forwards it to its workers, which it starts in
  sessions of their own; the wrapper keeps track of every process under the command (Linux ``/proc``), so
  that after ``grace_s`` (or once the command has ended) any of them still running gets the signal and then
  ``SIGKILL``: no worker is left behind, orphaned, holding its GPU.
- A command ended that way makes the wrapper report the conventional status, 128 + the signal's number
  (130 for ``SIGINT``).

>>> import sys
>>> run_supervised([sys.executable, "-c", "raise SystemExit(3)"], env=None)
(3, None)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["TERMINATING", "descendants", "run_supervised"]

TERMINATING = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)
"""The signals that end a run: forwarded to the command's process group, and the wrapper's status 128 + N."""

_POLL_S = 0.2


def _stat(pid: int) -> tuple[int, int] | None:
    """``(ppid, start time)`` of ``pid`` from ``/proc/<pid>/stat``, or ``None`` (gone, or no ``/proc``)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def descendants(pid: int) -> dict[int, int]:
    """Every process under ``pid`` (children, theirs, ...) with its start time; ``{}`` without ``/proc``."""
    children: dict[int, list[tuple[int, int]]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for name in entries:
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                children.setdefault(st[0], []).append((int(name), st[1]))
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            if child not in out:
                out[child] = start
                todo.append(child)
    return out


def _alive(pid: int, start: int) -> bool:
    """Whether ``pid`` still runs as the process seen at ``start`` (not a zombie, not a reused pid)."""
    st = _stat(pid)
    if st is None or st[1] != start:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _send(pid: int, sig: int, group: bool = False) -> None:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _popen(command: Sequence[str], env: Mapping[str, str] | None) -> subprocess.Popen[Any]:
    """``command`` in a new process group (not a new session: it keeps the terminal for its output)."""
    if sys.version_info >= (3, 11):
        return subprocess.Popen(list(command), env=env, process_group=0)
    return subprocess.Popen(list(command), env=env, preexec_fn=os.setpgrp)  # Python 3.10


def run_supervised(
    command: Sequence[str], env: Mapping[str, str] | None, grace_s: float = 30.0
) -> tuple[int, int | None]:
    """Run ``command`` to its end: ``(its status, the first terminating signal the wrapper got or None)``.
    Must run in the main thread (it installs the signal handlers, and restores them after). Raises
    ``OSError`` when the command cannot be started."""
    child = _popen(command, env)
    got: list[int] = []
    tree: dict[int, int] = {}

    def forward(signum: int, _frame: Any) -> None:
        got.append(signum)
        tree.update(descendants(child.pid))  # before anything under the command ends and is reparented
        _send(child.pid, signum, group=True)

    previous = {sig: signal.signal(sig, forward) for sig in TERMINATING}
    deadline: float | None = None
    try:
        while True:
            try:
                status = child.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if got:  # told to stop: know every process under the command, and end them after the grace
                tree.update(descendants(child.pid))
                deadline = deadline if deadline is not None else time.monotonic() + grace_s
                if time.monotonic() >= deadline:
                    _send(child.pid, signal.SIGKILL, group=True)
                    for pid, start in tree.items():
                        if _alive(pid, start):
                            _send(pid, signal.SIGKILL)
        if got:
            _end_survivors(tree, got[0], deadline if deadline is not None else time.monotonic() + grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return (status if status >= 0 else 128 - status), (got[0] if got else None)


def _end_survivors(tree: Mapping[int, int], signum: int, deadline: float) -> None:
    """After the command ended on a signal: what still runs under it (started in sessions of their own, so the
    group's signal never reached them) gets the signal, then ``SIGKILL`` at ``deadline``; wait until gone."""
    left = {pid: start for pid, start in tree.items() if _alive(pid, start)}
    for pid in left:
        _send(pid, signum)
    while left and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        left = {pid: start for pid, start in left.items() if _alive(pid, start)}
    for pid in left:
        _send(pid, signal.SIGKILL)
    until = time.monotonic() + 5.0
    while left and time.monotonic() < until:
        time.sleep(0.05)
        left = {pid: start for pid, start in left.items() if _alive(pid, start)}
