"""``check REPORT.jsonl`` (the CI guard) and ``show REPORT.jsonl [--plot FILE.png]``: the commands that read a
report (``reporting/summary.py``, ``reporting/terminal.py``). :data:`CHECK` and :data:`SHOW` are the commands."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from rich.console import Console

from weightsync_audit.cli import CliError, add_allow_torn, add_json, add_report
from weightsync_audit.reporting.render import log_console
from weightsync_audit.reporting.summary import ReportSummary
from weightsync_audit.reporting.terminal import check_report, show_summary

__all__ = ["CHECK", "SHOW", "cmd_show"]


def _check_arguments(p: argparse.ArgumentParser) -> None:
    add_report(p)
    add_json(p, "the summary")
    add_allow_torn(p)
    p.add_argument(
        "--accept-repaired",
        action="store_true",
        help="exit 0 when every divergence was repaired by resync, none came back after its repair, and the run "
        "ended in sync",
    )


CHECK = SimpleNamespace(
    SUMMARY="summarise a report; exit 0 in sync, 1 diverged or a checkpoint failed, 2 unreadable or nothing compared",
    DESCRIPTION="""
    Read a JSONL audit report and say whether every audit found the replicas in sync; name the first divergence
    (step, epoch, tensors, ranks, hint). Exit 0 when every record is in sync, 1 when any is not, or when a
    checkpoint was loaded changed since it was saved or unverified, or a resume check found a difference
    (checkpoint.resume.status: differs; each named with why), 2 when the file cannot be read, holds no records, or a
    line is not a valid record, or when no audit compared a tensor between ranks (no verdict: status
    'nothing_compared'). A run with on_mismatch='resync' whose every divergence was repaired and that ended in sync
    exits 1 too, unless --accept-repaired is given (then 0, status 'repaired'); a cause that came back after its
    repair (a rank or tensor diverging again after a resync) is not repaired: exit 1 even with --accept-repaired.
    """,
    EXAMPLES="""
    example (a CI step that fails on divergence):
      WEIGHTSYNC_AUDIT=report_path=audit.jsonl python train.py
      weightsync-audit check audit.jsonl
      weightsync-audit check audit.jsonl --json > audit-summary.json
      weightsync-audit check audit.jsonl --accept-repaired   # a resync run that ended in sync passes
    """,
    add_arguments=_check_arguments,
    run=lambda args: check_report(
        args.report, as_json=args.json, allow_torn=args.allow_torn, accept_repaired=args.accept_repaired
    ),
)


def _show_arguments(p: argparse.ArgumentParser) -> None:
    add_report(p)
    p.add_argument("--plot", metavar="FILE.png", help="also draw the run to this image (.png, .svg, .pdf)")
    p.add_argument("--by", choices=("tensor", "layer"), default="tensor", help="plot rows (default: tensor)")
    add_allow_torn(p)


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


SHOW = SimpleNamespace(
    SUMMARY="timeline and per-layer table of a report; --plot draws it",
    DESCRIPTION="""
    Lay out a JSONL audit report in the terminal: a timeline of in-sync and diverged stretches and a table of the
    layers that diverged, with their ranks and gaps. --plot draws tensors (or layers) against steps, coloured by in
    sync / diverged and by max |diff| (needs matplotlib: pip install matplotlib). Exit 0 when shown, 2 when the file
    is unreadable or holds an invalid line.
    """,
    EXAMPLES="""
    example:
      weightsync-audit show audit.jsonl
      weightsync-audit show audit.jsonl --plot run.png --by layer
    """,
    add_arguments=_show_arguments,
    run=lambda args: cmd_show(args.report, plot=args.plot, by=args.by, allow_torn=args.allow_torn),
)
