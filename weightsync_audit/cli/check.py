"""``check REPORT.jsonl``: the CI guard; exit 0 in sync, 1 diverged, 2 unreadable or nothing compared."""

from __future__ import annotations

import argparse

from weightsync_audit.cli.command import add_allow_torn, add_json, add_report
from weightsync_audit.reporting.terminal import check_report

__all__ = ["DESCRIPTION", "EXAMPLES", "SUMMARY", "add_arguments", "run"]


SUMMARY = "summarise a report; exit 0 in sync, 1 diverged, 2 unreadable or nothing compared"

DESCRIPTION = """
    Read a JSONL audit report and say whether every audit found the replicas in sync; name the first divergence
    (step, epoch, tensors, ranks, hint). Exit 0 when every record is in sync, 1 when any is not, 2 when the file
    cannot be read, holds no records, or a line is not a valid record, or when no audit compared a tensor between
    ranks (no verdict: status 'nothing_compared'). A run with on_mismatch='resync' whose every
    divergence was repaired and that ended in sync exits 1 too, unless --accept-repaired is given (then 0, status
    'repaired'); a cause that came back after its repair (a rank or tensor diverging again after a resync) is not
    repaired: exit 1 even with --accept-repaired.
"""

EXAMPLES = """
    example (a CI step that fails on divergence):
      WEIGHTSYNC_AUDIT=report_path=audit.jsonl python train.py
      weightsync-audit check audit.jsonl
      weightsync-audit check audit.jsonl --json > audit-summary.json
      weightsync-audit check audit.jsonl --accept-repaired   # a resync run that ended in sync passes
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``check``'s arguments."""
    add_report(p)
    add_json(p, "the summary")
    add_allow_torn(p)
    p.add_argument(
        "--accept-repaired",
        action="store_true",
        help="exit 0 when every divergence was repaired by resync, none came back after its repair, and the run "
        "ended in sync",
    )


def run(args: argparse.Namespace) -> int:
    """Summarise the report (``reporting/terminal.py``); its exit code."""
    return check_report(
        args.report, as_json=args.json, allow_torn=args.allow_torn, accept_repaired=args.accept_repaired
    )
