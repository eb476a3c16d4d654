"""``launch [--evict-file F] [--segment-health-dir D] [--grace-period S] -- COMMAND ...``: run a launcher
(torchrun, srun, a script), hand the evict file to its ranks, and exit with the run's own ``exit_code`` when
it ended on a divergence, whatever status the launcher itself gives (torchrun exits 1 when a worker exits 17).

- Before anything runs, the evict file and the segment health-check folder are checked: one that cannot be
  written is an error naming its option (status 2), not a run whose hand-off is lost at its end.
- The command runs with ``WEIGHTSYNC_EVICT_FILE`` (``--evict-file``, default ``weightsync-evict.json`` in
  the current folder), ``WEIGHTSYNC_LAUNCH_ID`` (a fresh id: an older file is never read as this run's),
  ``WEIGHTSYNC_EXIT_STATUS_DIR`` (a private folder where every rank that ends the run with ``exit_code``
  leaves its status) and, with ``--segment-health-dir``, ``WEIGHTSYNC_SEGMENT_HEALTH_DIR``.
- Exit status: the command's when it succeeded (0: a restart inside it may have recovered; said on stderr)
  or when the run did not end on a divergence; else the run's ``exit_code`` (17 by the docs' recipe), read
  from the evict file or, when that could not be written, from the ranks' statuses, so a scheduler can
  requeue on that status alone. The file names the hosts to leave out.
- ``SIGINT``, ``SIGTERM``, ``SIGHUP`` and ``SIGQUIT`` are forwarded to the command's process group; what still
  runs under it after ``--grace-period`` seconds (default 30: torchrun's own) is killed, workers included,
  and the status is 128 + the signal's number (130 for Ctrl-C). The command runs in a process group of its own,
  so a terminal's Ctrl-C reaches it once, through the wrapper (torchrun's shutdown is interrupted by a second
  signal); torchrun starts its workers in sessions of their own, so the wrapper tracks every process under
  the command (Linux ``/proc``) and signals, then kills, any still running: no worker is left holding its GPU
  (:func:`run_supervised`). A signal ignored when the wrapper starts stays ignored, by it and by the command
  (``nohup``'s ``SIGHUP``; ``SIGINT`` and ``SIGQUIT`` of a command a script starts in the background), as
  the shell meant: it is neither caught nor forwarded.

>>> import sys, tempfile
>>> cmd_launch([sys.executable, "-c", "raise SystemExit(3)"], evict_file=f"{tempfile.mkdtemp()}/e.json", quiet=True)
3
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

from weightsync_audit.cli import CliError
from weightsync_audit.integrations.evict import (
    EVICT_FILE_ENV,
    EXIT_STATUS_DIR_ENV,
    LAUNCH_ID_ENV,
    SEGMENT_DIR_ENV,
    read_evict,
    read_exit_statuses,
    unwritable,
)

__all__ = [
    "DESCRIPTION",
    "EXAMPLES",
    "SUMMARY",
    "TERMINATING",
    "add_arguments",
    "cmd_launch",
    "descendants",
    "run",
    "run_supervised",
]


SUMMARY = "run torchrun (or any launcher) and exit with the run's exit_code after a divergence"

DESCRIPTION = """
    Run COMMAND with WEIGHTSYNC_EVICT_FILE set; when the run ended on a divergence (exit_code=17 on every rank) exit
    with that status even though torchrun exits 1, and leave the evict file naming the hosts to leave out
    (docs/restarts.md). SIGINT, SIGTERM, SIGHUP and SIGQUIT are forwarded to the command's process group; what
    still runs under it after --grace-period seconds is killed, and the status is 128 + the signal's number.
"""

EXAMPLES = """
    example:
      weightsync-audit launch --evict-file evict.json -- torchrun --nproc_per_node=8 --max-restarts=1 train.py
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``launch``'s arguments."""
    p.add_argument("--evict-file", default=None, help="the JSON evict file (default ./weightsync-evict.json)")
    p.add_argument("--segment-health-dir", default=None, help="NVRx ft_launcher's --ft-segment-health-check-dir")
    p.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        metavar="S",
        help="after a signal, seconds before what still runs under the command is killed (default 30)",
    )
    p.add_argument("launched", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the launcher and its arguments")


def run(args: argparse.Namespace) -> int:
    """Run the launcher; its exit status, or the run's ``exit_code`` after a divergence."""
    return cmd_launch(
        args.launched,
        evict_file=args.evict_file,
        segment_health_dir=args.segment_health_dir,
        grace_s=args.grace_period,
    )


def _said(doc: dict[str, Any]) -> str:
    hosts = ", ".join(f"rank {h['rank']} on {h.get('host') or '?'}" for h in doc.get("hosts", [])) or "no host named"
    return f"the replicas diverged at step {doc.get('step')} (attempt {doc.get('attempt', 0)}); evict: {hosts}"


def _checked_paths(evict_file: str | None, segment_health_dir: str | None) -> tuple[Path, Path | None]:
    """The hand-off paths, absolute, once each is known to be writable (else a :class:`CliError` naming it)."""
    evict = Path(evict_file or "weightsync-evict.json").absolute()
    why = unwritable(evict)
    if why is not None:
        raise CliError(f"--evict-file {evict}: cannot be written ({why}); the run's hand-off would be lost")
    health = Path(segment_health_dir).absolute() if segment_health_dir else None
    why = unwritable(health, folder=True) if health is not None else None
    if why is not None:
        raise CliError(f"--segment-health-dir {health}: cannot be written in ({why})")
    return evict, health


def cmd_launch(
    command: Sequence[str],
    *,
    evict_file: str | None = None,
    segment_health_dir: str | None = None,
    grace_s: float = 30.0,
    quiet: bool = False,
) -> int:
    """Run ``command`` with the hand-off variables set; its exit status, or the run's ``exit_code``."""
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("launch needs a command after --, e.g. weightsync-audit launch -- torchrun ... train.py")
    if not grace_s >= 0:
        raise CliError(f"--grace-period {grace_s}: must be a number of seconds, 0 or more")
    evict, health = _checked_paths(evict_file, segment_health_dir)
    launch_id = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="weightsync-launch-") as statuses:
        env = {**os.environ, EVICT_FILE_ENV: str(evict), LAUNCH_ID_ENV: launch_id, EXIT_STATUS_DIR_ENV: statuses}
        if health is not None:
            env[SEGMENT_DIR_ENV] = str(health)
        try:
            status, signum = run_supervised(command, env, grace_s)
        except OSError as exc:
            raise CliError(f"cannot run {command[0]}: {exc}") from None
        exits = read_exit_statuses(statuses)
    if signum is not None:
        if not quiet:
            sys.stderr.write(f"weightsync launch: stopped by {signal.Signals(signum).name}; the command ended\n")
        return 128 + signum
    doc = read_evict(evict, launch_id)
    if status == 0:
        if doc is not None and not quiet:
            sys.stderr.write(f"weightsync launch: the run completed after a restart: {_said(doc)} ({evict})\n")
        return 0
    if doc is not None:
        code = int(doc.get("exit_code") or status or 1)
        if not quiet:
            sys.stderr.write(f"weightsync launch: {_said(doc)}; exiting with status {code} ({evict})\n")
        return code
    if exits:
        code = int(exits[-1]["exit_code"])  # the last attempt's
        if not quiet:
            ranks = ", ".join(str(e.get("rank")) for e in exits if e.get("attempt") == exits[-1].get("attempt"))
            sys.stderr.write(
                f"weightsync launch: the replicas diverged at step {exits[-1].get('step')} (ranks {ranks} exited "
                f"{code}); the evict file {evict} could not be written (see the ranks' warnings); exiting with "
                f"status {code}\n"
            )
        return code
    return status


TERMINATING = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)
"""The signals that end a run: forwarded to the command's process group, and the wrapper's status 128 + N."""

_POLL_S = 0.2


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, start time)`` of ``pid`` from ``/proc/<pid>/stat``, or ``None`` (gone, or no ``/proc``)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    try:
        return fields[0], int(fields[1]), int(fields[19])
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
                children.setdefault(st[1], []).append((int(name), st[2]))
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
    return st is not None and st[2] == start and st[0] != "Z"


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

    # One ignored when the wrapper started stays so (nohup's SIGHUP), as the command, which inherits it, does.
    caught = [sig for sig in TERMINATING if signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, forward) for sig in caught}
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
