"""What every ``weightsync-audit`` command shares: its parser class, its one-line error, the way it registers.

A command owns its parser and its run function: ``SUMMARY``, ``DESCRIPTION`` and ``EXAMPLES`` (its help),
``add_arguments(parser)`` (its options) and ``run(args) -> int`` (the exit status): a module of this folder
(``demo``, ``launch``), or one of the commands a module holds by noun (``reports``: ``CHECK``, ``SHOW``;
``checkpoints``: ``DIFF``, ``VERIFY``). :func:`add_command` registers one, so the dispatcher
(``cli/__init__.py``) only builds the top parser and calls ``args.run(args)``. A command module imports no torch at import time:
``check --help`` and ``show`` start without it.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from types import ModuleType
from typing import Any, NoReturn

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
    "one_line",
]

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
