"""``launch [--evict-file F] [--segment-health-dir D] -- COMMAND ...``: run a launcher (torchrun, srun, a
script), hand the evict file to its ranks, and exit with the run's own ``exit_code`` when it ended on a
divergence, whatever status the launcher itself gives (torchrun exits 1 when a worker exits 17).

- The command runs with ``WEIGHTSYNC_EVICT_FILE`` (``--evict-file``, default ``weightsync-evict.json`` in
  the current folder), ``WEIGHTSYNC_LAUNCH_ID`` (a fresh id: an older file is never read as this run's)
  and, with ``--segment-health-dir``, ``WEIGHTSYNC_SEGMENT_HEALTH_DIR``.
- Exit status: the command's when it succeeded (0: a restart inside it may have recovered; said on stderr)
  or when no evict file of this launch exists; else the evict file's ``exit_code`` (17 by the docs'
  recipe), so a scheduler can requeue on that status alone. The file names the hosts to leave out.

>>> import sys
>>> cmd_launch([sys.executable, "-c", "raise SystemExit(3)"], evict_file="/nonexistent/dir/e.json", quiet=True)
3
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Sequence

from weightsync_audit.cli.command import CliError
from weightsync_audit.integrations.evict import EVICT_FILE_ENV, LAUNCH_ID_ENV, SEGMENT_DIR_ENV, read_evict

__all__ = ["DESCRIPTION", "EXAMPLES", "SUMMARY", "add_arguments", "cmd_launch", "run"]


SUMMARY = "run torchrun (or any launcher) and exit with the run's exit_code after a divergence"

DESCRIPTION = """
    Run COMMAND with WEIGHTSYNC_EVICT_FILE set; when the run ended on a divergence (exit_code=17 on every rank) exit
    with that status even though torchrun exits 1, and leave the evict file naming the hosts to leave out
    (docs/restarts.md).
"""

EXAMPLES = """
    example:
      weightsync-audit launch --evict-file evict.json -- torchrun --nproc_per_node=8 --max-restarts=1 train.py
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``launch``'s arguments."""
    p.add_argument("--evict-file", default=None, help="the JSON evict file (default ./weightsync-evict.json)")
    p.add_argument("--segment-health-dir", default=None, help="NVRx ft_launcher's --ft-segment-health-check-dir")
    p.add_argument("launched", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the launcher and its arguments")


def run(args: argparse.Namespace) -> int:
    """Run the launcher; its exit status, or the run's ``exit_code`` after a divergence."""
    return cmd_launch(args.launched, evict_file=args.evict_file, segment_health_dir=args.segment_health_dir)


def _said(doc: dict[str, Any]) -> str:
    hosts = ", ".join(f"rank {h['rank']} on {h.get('host') or '?'}" for h in doc.get("hosts", [])) or "no host named"
    return f"the replicas diverged at step {doc.get('step')} (attempt {doc.get('attempt', 0)}); evict: {hosts}"


def cmd_launch(
    command: Sequence[str],
    *,
    evict_file: str | None = None,
    segment_health_dir: str | None = None,
    quiet: bool = False,
) -> int:
    """Run ``command`` with the hand-off variables set; its exit status, or the run's ``exit_code``."""
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("launch needs a command after --, e.g. weightsync-audit launch -- torchrun ... train.py")
    evict = Path(evict_file or "weightsync-evict.json").absolute()
    launch_id = uuid.uuid4().hex
    env = {**os.environ, EVICT_FILE_ENV: str(evict), LAUNCH_ID_ENV: launch_id}
    if segment_health_dir:
        env[SEGMENT_DIR_ENV] = str(Path(segment_health_dir).absolute())
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise CliError(f"cannot run {command[0]}: {exc}") from None
    previous = signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))  # a scheduler's stop
    try:
        status = child.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    doc = read_evict(evict, launch_id)
    if doc is None:
        return status if status >= 0 else 128 - status
    if status == 0:
        if not quiet:
            sys.stderr.write(f"weightsync launch: the run completed after a restart: {_said(doc)} ({evict})\n")
        return 0
    code = int(doc.get("exit_code") or status or 1)
    if not quiet:
        sys.stderr.write(f"weightsync launch: {_said(doc)}; exiting with status {code} ({evict})\n")
    return code
