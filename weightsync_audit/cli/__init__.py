"""The ``weightsync-audit`` command: ``demo``, ``check``, ``show``, ``diff``, ``verify``, ``launch``.

A command owns its parser and its run function: ``SUMMARY``, ``DESCRIPTION`` and ``EXAMPLES`` (its help),
``add_arguments(parser)`` (its options) and ``run(args) -> int`` (the exit status): a module of this folder
(``demo``, ``launch``), or one of the commands a module holds by noun (``reports``: ``CHECK``, ``SHOW``;
``checkpoints``: ``DIFF``, ``VERIFY``). :func:`add_command` registers one, so this module only builds the top
parser and calls ``args.run(args)``; what every command shares (:class:`Parser`, :class:`CliError`, the
common options) is here too. A command module imports no torch at import time: ``check --help`` and
``show`` start without it.

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
import textwrap
from types import ModuleType
from typing import Any, NoReturn, Sequence

from weightsync_audit.errors import CheckpointError, ReportReadError
from weightsync_audit.reporting.summary import EXIT_DIFFERENT, EXIT_ERROR, EXIT_OK

__all__ = ["main", "build_parser", "command", "EXIT_OK", "EXIT_DIFFERENT", "EXIT_ERROR"]

PROG = "weightsync-audit"


class CliError(Exception):
    """A one-line error for the user; the command exits with status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points at --help."""

    def error(self, message: str) -> NoReturn:
        """Write the usage error as one line and exit 2."""
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(EXIT_ERROR)


def dedent(text: str) -> str:
    """A help text written indented in the source, as printed (no leading or trailing blank line)."""
    return textwrap.dedent(text).strip("\n")


def one_line(text: str) -> str:
    """A paragraph written wrapped in the source, as one line (argparse prints a description as given)."""
    return " ".join(text.split())


def add_command(sub: Any, name: str, command: ModuleType | Any) -> Parser:
    """Register ``command`` (``cli/demo.py``, ``reports.CHECK``, ...) as the sub-command ``name``: its
    ``SUMMARY`` (a line in the top ``--help``), ``DESCRIPTION`` and ``EXAMPLES`` (its own ``--help``), its
    ``add_arguments(parser)``; the parsed arguments go to its ``run(args)``."""
    parser: Parser = sub.add_parser(
        name,
        help=command.SUMMARY,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=one_line(command.DESCRIPTION),
        epilog=dedent(command.EXAMPLES),
    )
    command.add_arguments(parser)
    parser.set_defaults(run=command.run)
    return parser


def add_report(parser: argparse.ArgumentParser) -> None:
    """The ``REPORT.jsonl`` positional of the commands that read a report."""
    parser.add_argument("report", metavar="REPORT.jsonl")


def add_allow_torn(parser: argparse.ArgumentParser) -> None:
    """``--allow-torn``: accept a torn last line (a run that crashed mid-write)."""
    parser.add_argument(
        "--allow-torn", action="store_true", help="accept a torn last line (a run that crashed mid-write)"
    )


def add_json(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json``: print ``what`` (the summary, the comparison, the outcome) as JSON, with the same exit codes."""
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON (same exit codes)")


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
