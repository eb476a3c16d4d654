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
  and the status is 128 + the signal's number (130 for Ctrl-C).

>>> import sys, tempfile
>>> cmd_launch([sys.executable, "-c", "raise SystemExit(3)"], evict_file=f"{tempfile.mkdtemp()}/e.json", quiet=True)
3
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Sequence

from weightsync_audit.cli.command import CliError
from weightsync_audit.integrations.evict import (
    EVICT_FILE_ENV,
    EXIT_STATUS_DIR_ENV,
    LAUNCH_ID_ENV,
    SEGMENT_DIR_ENV,
    read_evict,
    read_exit_statuses,
    unwritable,
)
from weightsync_audit.integrations.supervise import run_supervised

__all__ = ["DESCRIPTION", "EXAMPLES", "SUMMARY", "add_arguments", "cmd_launch", "run"]


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
