"""The ``weightsync-audit`` command: ``demo``, ``check``, ``show``, ``diff``, ``verify``, ``launch``.

Each command owns its parser and its run function (``cli/command.py`` says how): ``demo`` and ``launch`` a
module each, ``check`` and ``show`` in ``reports``, ``diff`` and ``verify`` in ``checkpoints``; this module
builds the top parser and dispatches.

Exit codes (the contract): ``check`` 0 in sync, 1 diverged, 2 unreadable or nothing compared (0 for a run repaired by
resync and in sync at the end with ``--accept-repaired``); ``show`` 0 / 2; ``diff`` 0 identical or
equal within ``--atol``, 1 different, 2 error; every error is one line on stderr, never a traceback.

>>> main(["--version"])  # doctest: +ELLIPSIS
weightsync-audit ...
0
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from weightsync_audit.cli.command import (
    EXIT_DIFFERENT,
    EXIT_ERROR,
    EXIT_OK,
    PROG,
    CliError,
    Parser,
    add_command,
    dedent,
)
from weightsync_audit.errors import CheckpointError, ReportReadError

__all__ = ["main", "build_parser", "command", "EXIT_OK", "EXIT_DIFFERENT", "EXIT_ERROR"]

HOMES = {"demo": "demo", "check": "reports", "show": "reports", "diff": "checkpoints", "verify": "checkpoints"}
HOMES["launch"] = "launch"
"""The module of this folder each command lives in, in the order ``--help`` lists the commands."""

COMMANDS = tuple(HOMES)


def command(name: str) -> object:
    """The command ``name``: its module (``demo``), or the command of that name its module holds (``CHECK``)."""
    module = importlib.import_module(f"{__name__}.{HOMES[name]}")
    return getattr(module, name.upper(), module)


ONE_LINE_ERRORS = (CliError, ReportReadError, CheckpointError)
"""Errors said to the user in one line (exit 2): a usage the parser could not refuse, an unreadable file."""

EXIT_CODES = dedent(
    """
    exit codes:
      check  0 every audit in sync (or within the run's tolerance; or, with --accept-repaired, every
               divergence repaired by resync, none back after its repair, and in sync at the end),
               1 a divergence, a checkpoint loaded changed or unverified, or a resume that differs,
               2 unreadable/invalid/empty
               or nothing compared (no audit compared a tensor between ranks: no verdict)
      show   0 shown, 2 unreadable or invalid
      diff   0 identical (or equal within --atol), 1 different (a file truncated or damaged beside a readable
               one included; or, by sidecars, a file no longer the one its sidecar identifies),
               2 not a checkpoint, unreadable alone, refused, or a path leading outside its folder
      verify 0 verified and unchanged, 1 unverified, diverged or changed (a truncated file included),
               2 not a checkpoint, unreadable, malformed, refused, or a path leading outside its folder
      demo   0 the audit told the two runs apart as expected, 1 it did not
    every error is one line on stderr (set WEIGHTSYNC_AUDIT_DEBUG=1 for a traceback)
    """
)


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: one sub-command each for ``demo``, ``check``, ``show``, ``diff``, ``verify``, ``launch``."""
    from weightsync_audit import __version__

    parser = Parser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Audit whether data-parallel replicas hold the same weights: read audit reports, compare "
        "checkpoints, run the demo. A report is the JSONL file the audit writes with report_path=... "
        "(WeightSyncAudit, WeightSyncAuditCallback, Auditor) or WEIGHTSYNC_AUDIT=report_path=...",
        epilog=dedent(
            """
            examples:
              weightsync-audit demo                       # Lightning #20340 on 2 CPU ranks, then fixed
              weightsync-audit check audit.jsonl          # CI guard: exit 1 when replicas diverged
              weightsync-audit show audit.jsonl --plot run.png
              weightsync-audit diff rank0.ckpt rank1.ckpt

            run `weightsync-audit COMMAND --help` for each command's options and examples.
            """
        )
        + "\n\n"
        + EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMANDS:
        add_command(sub, name, command(name))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it).

    >>> main(["check", "/nonexistent/audit.jsonl"])
    2
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_ERROR
    if args.command is None:
        parser.print_help()
        return EXIT_ERROR
    try:
        return int(args.run(args))
    except ONE_LINE_ERRORS as exc:
        sys.stderr.write(f"{PROG} {args.command}: error: {exc}\n")
        return EXIT_ERROR
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG} {args.command}: interrupted\n")
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:
        if os.environ.get("WEIGHTSYNC_AUDIT_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        sys.stderr.write(
            f"{PROG} {args.command}: error: {type(exc).__name__}: {first} "
            "(set WEIGHTSYNC_AUDIT_DEBUG=1 for the traceback)\n"
        )
        return EXIT_ERROR
