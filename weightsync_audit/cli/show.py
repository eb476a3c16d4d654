"""``show REPORT.jsonl [--plot FILE.png]``: a report's timeline and per-layer table; exit 0 shown, 2 unreadable."""

from __future__ import annotations

import argparse

from rich.console import Console

from weightsync_audit.cli.command import CliError, add_allow_torn, add_report
from weightsync_audit.reporting.render import log_console
from weightsync_audit.reporting.summary import ReportSummary
from weightsync_audit.reporting.terminal import show_summary

__all__ = ["DESCRIPTION", "EXAMPLES", "SUMMARY", "add_arguments", "cmd_show", "run"]


SUMMARY = "timeline and per-layer table of a report; --plot draws it"

DESCRIPTION = """
    Lay out a JSONL audit report in the terminal: a timeline of in-sync and diverged stretches and a table of the
    layers that diverged, with their ranks and gaps. --plot draws tensors (or layers) against steps, coloured by in
    sync / diverged and by max |diff| (needs matplotlib: pip install matplotlib). Exit 0 when shown, 2 when the file
    is unreadable or holds an invalid line.
"""

EXAMPLES = """
    example:
      weightsync-audit show audit.jsonl
      weightsync-audit show audit.jsonl --plot run.png --by layer
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``show``'s arguments."""
    add_report(p)
    p.add_argument("--plot", metavar="FILE.png", help="also draw the run to this image (.png, .svg, .pdf)")
    p.add_argument("--by", choices=("tensor", "layer"), default="tensor", help="plot rows (default: tensor)")
    add_allow_torn(p)


def run(args: argparse.Namespace) -> int:
    """Lay the report out, and draw it with ``--plot``."""
    return cmd_show(args.report, plot=args.plot, by=args.by, allow_torn=args.allow_torn)


def cmd_show(
    path: str,
    *,
    plot: str | None = None,
    by: str = "tensor",
    allow_torn: bool = False,
    console: Console | None = None,
) -> int:
    """Lay a report out in the terminal (and optionally draw it); 0 shown, 2 unreadable or invalid."""
    summary = ReportSummary.read(path, allow_torn)
    console = console or log_console()
    code = show_summary(summary, console)
    if plot is not None and summary.records:
        from weightsync_audit.reporting.plot import PlotUnavailableError, plot_report

        try:
            out = plot_report(summary.results, plot, by=by)
        except PlotUnavailableError as exc:
            raise CliError(str(exc)) from None
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot write the plot to {plot}: {exc}") from None
        console.print(f"plot written to {out}")
    return code
