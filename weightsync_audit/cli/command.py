"""What every ``weightsync-audit`` command shares: its parser class, its one-line error, the way it registers.

A command is a module of this folder with ``add_parser(sub)`` (its sub-command, options and help) and
``run(args) -> int`` (the exit status); :func:`add_command` ties the two together, so the dispatcher
(``cli/__init__.py``) only builds the top parser and calls ``args.run(args)``. A command module imports
no torch at import time: ``check --help`` and ``show`` start without it.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Any, Callable, NoReturn

from weightsync_audit.reporting.summary import EXIT_DIFFERENT, EXIT_ERROR, EXIT_OK

__all__ = [
    "EXIT_DIFFERENT",
    "EXIT_ERROR",
    "EXIT_OK",
    "PROG",
    "CliError",
    "Parser",
    "add_allow_torn",
    "add_command",
    "add_json",
    "add_report",
    "dedent",
]

PROG = "weightsync-audit"

Run = Callable[[argparse.Namespace], int]


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


def add_command(sub: Any, name: str, run: Run, *, summary: str, description: str, examples: str) -> Parser:
    """Register the sub-command ``name``: its one-line ``summary`` (in the top ``--help``), ``description``
    and ``examples`` (in its own ``--help``); ``run`` is called with the parsed arguments."""
    parser: Parser = sub.add_parser(
        name,
        help=summary,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=description,
        epilog=dedent(examples),
    )
    parser.set_defaults(run=run)
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
