"""The ``weightsync-audit`` command: ``demo``, ``check``, ``show``, ``diff``.

Exit codes (the contract): ``check`` 0 in sync, 1 diverged, 2 unreadable (0 for a run repaired by
resync and in sync at the end with ``--accept-repaired``); ``show`` 0 / 2; ``diff`` 0 identical or
equal within ``--atol``, 1 different, 2 error; every error is one line on stderr, never a traceback.

>>> main(["--version"])
0
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Any, NoReturn, Sequence

from weightsync_audit.cli._summary import EXIT_DIFFERENT, EXIT_ERROR, EXIT_OK, CliError

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_DIFFERENT", "EXIT_ERROR"]

PROG = "weightsync-audit"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points at --help."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(EXIT_ERROR)


def _help(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


EXIT_CODES = _help(
    """
    exit codes:
      check  0 every audit in sync (or within the run's tolerance; or, with --accept-repaired, every
               divergence repaired by resync and in sync at the end), 1 a divergence, 2 unreadable/invalid/empty
      show   0 shown, 2 unreadable or invalid
      diff   0 identical (or equal within --atol), 1 different, 2 unreadable, refused or not a checkpoint
      demo   0 the audit told the two runs apart as expected, 1 it did not
    every error is one line on stderr (set WEIGHTSYNC_AUDIT_DEBUG=1 for a traceback)
    """
)


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: one sub-command each for ``demo``, ``check``, ``show``, ``diff``, ``verify``, ``launch``."""
    from weightsync_audit.version import __version__

    parser = _Parser(
        prog=PROG,
        formatter_class=_FMT,
        description="Audit whether data-parallel replicas hold the same weights: read audit reports, compare "
        "checkpoints, run the demo. A report is the JSONL file the audit writes with report_path=... "
        "(WeightSyncAudit, WeightSyncAuditCallback, Auditor) or WEIGHTSYNC_AUDIT=report_path=...",
        epilog=_help(
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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_demo(sub)
    _add_check(sub)
    _add_show(sub)
    _add_diff(sub)
    _add_verify(sub)
    _add_launch(sub)
    return parser


_FMT = argparse.RawDescriptionHelpFormatter


def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run Lightning #20340 on CPU ranks: the divergence found and explained, then fixed",
        formatter_class=_FMT,
        description="Train the bug report's model twice with DDP on CPU ranks: as reported (the replicas part at "
        "epoch 3, when BackboneFinetuning unfreezes the backbone) and with DDPRewrapOnTrainableChange (in sync "
        "throughout). Every step is audited; the reports are written as JSONL. Exit 0 when the audit tells the "
        "two runs apart as expected, 1 when it does not, 2 on an error.",
        epilog=_help(
            """
            example:
              weightsync-audit demo --ranks 2 --epochs 5 --report ./demo-reports
              weightsync-audit show ./demo-reports/without-fix.jsonl
            """
        ),
    )
    p.add_argument("--ranks", type=int, default=2, help="number of CPU ranks (default: 2)")
    p.add_argument(
        "--epochs", type=int, default=5, help="epochs per run; the backbone unfreezes at epoch 3 (default: 5)"
    )
    p.add_argument(
        "--report", metavar="DIR", help="folder for without-fix.jsonl and with-fix.jsonl (default: a temp folder)"
    )


def _add_check(sub: Any) -> None:
    p = sub.add_parser(
        "check",
        help="summarise a report; exit 0 in sync, 1 diverged, 2 unreadable",
        formatter_class=_FMT,
        description="Read a JSONL audit report and say whether every audit found the replicas in sync; name the "
        "first divergence (step, epoch, tensors, ranks, hint). Exit 0 when every record is in sync, 1 when any "
        "is not, 2 when the file cannot be read, holds no records, or a line is not a valid record. A run with "
        "on_mismatch='resync' whose every divergence was repaired and that ended in sync exits 1 too, unless "
        "--accept-repaired is given (then 0, status 'repaired').",
        epilog=_help(
            """
            example (a CI step that fails on divergence):
              WEIGHTSYNC_AUDIT=report_path=audit.jsonl python train.py
              weightsync-audit check audit.jsonl
              weightsync-audit check audit.jsonl --json > audit-summary.json
              weightsync-audit check audit.jsonl --accept-repaired   # a resync run that ended in sync passes
            """
        ),
    )
    p.add_argument("report", metavar="REPORT.jsonl")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (same exit codes)")
    p.add_argument("--allow-torn", action="store_true", help="accept a torn last line (a run that crashed mid-write)")
    p.add_argument(
        "--accept-repaired",
        action="store_true",
        help="exit 0 when every divergence was repaired by resync and the run ended in sync",
    )


def _add_show(sub: Any) -> None:
    p = sub.add_parser(
        "show",
        help="timeline and per-layer table of a report; --plot draws it",
        formatter_class=_FMT,
        description="Lay out a JSONL audit report in the terminal: a timeline of in-sync and diverged stretches "
        "and a table of the layers that diverged, with their ranks and gaps. --plot draws tensors (or layers) "
        "against steps, coloured by in sync / diverged and by max |diff| (needs matplotlib: "
        "pip install matplotlib). Exit 0 when shown, 2 when the file is unreadable or holds an invalid line.",
        epilog=_help(
            """
            example:
              weightsync-audit show audit.jsonl
              weightsync-audit show audit.jsonl --plot run.png --by layer
            """
        ),
    )
    p.add_argument("report", metavar="REPORT.jsonl")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the run to this image (.png, .svg, .pdf)")
    p.add_argument("--by", choices=("tensor", "layer"), default="tensor", help="plot rows (default: tensor)")
    p.add_argument("--allow-torn", action="store_true", help="accept a torn last line (a run that crashed mid-write)")


def _add_diff(sub: Any) -> None:
    p = sub.add_parser(
        "diff",
        help="compare two checkpoints tensor by tensor; exit 0 identical, 1 different, 2 error",
        formatter_class=_FMT,
        description="Compare checkpoints tensor by tensor: Lightning .ckpt files, torch.save'd state dicts, or "
        "folders of per-rank files. Reports missing, extra, shape and dtype changes, and values with their max "
        "|diff|. Files are loaded with torch.load(weights_only=True): one that needs code to load is refused "
        "(exit 2), never executed; a file that is no checkpoint at all (a report, a text) is named as such "
        "(exit 2). With one folder, every file in it is compared with the first. With --atol, tensors that "
        "differ within it are 'EQUAL within atol' (exit 0), told apart from IDENTICAL (equal bits).",
        epilog=_help(
            """
            examples:
              weightsync-audit diff epoch=3.ckpt epoch=3-rerun.ckpt
              weightsync-audit diff ckpts/rank0.pt ckpts/rank1.pt --atol 1e-6
              weightsync-audit diff ckpts/                  # every rank's file against the first
              weightsync-audit diff a.ckpt b.ckpt --exclude 'loops.*' --exclude 'callbacks.*'
            """
        ),
    )
    p.add_argument("a", metavar="A", help="checkpoint file or folder")
    p.add_argument(
        "b", metavar="B", nargs="?", help="checkpoint file or folder (omit to compare the files of folder A)"
    )
    p.add_argument(
        "--atol", type=float, default=None, help="values within this max |diff| count as equal (default: exact bits)"
    )
    p.add_argument(
        "--exclude", action="append", default=[], metavar="GLOB", help="leave out names matching GLOB (repeatable)"
    )
    p.add_argument("--limit", type=int, default=50, help="rows shown per file pair (default: 50)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON (same exit codes)")
    p.add_argument("--full", action="store_true", help="load the files even when both sides have a sidecar")


def _add_verify(sub: Any) -> None:
    """Register ``verify`` on the command line's subparsers."""
    p = sub.add_parser(
        "verify",
        help="check a checkpoint against its sidecar; exit 0 verified and unchanged, 1 not, 2 unreadable",
        formatter_class=_FMT,
        description="Check a checkpoint (a file, a Hugging Face checkpoint folder, or a torch.distributed.checkpoint "
        "folder) against the sidecar weightsync wrote when it was saved: exit 0 when the replicas agreed at that "
        "step and every tensor (every shard) still has its digest, 1 when it has no sidecar, was saved while the "
        "replicas differed, or changed since (naming the tensors or shards and their ranks), 2 when unreadable.",
        epilog="example:\n  weightsync-audit verify checkpoints/epoch=3-step=400.ckpt\n",
    )
    p.add_argument("path", metavar="PATH", help="checkpoint file or folder")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON (same exit codes)")


def _add_launch(sub: Any) -> None:
    """Register ``launch`` (the restart recipe's wrapper: cli/launch.py)."""
    p = sub.add_parser(
        "launch",
        help="run torchrun (or any launcher) and exit with the run's exit_code after a divergence",
        formatter_class=_FMT,
        description="Run COMMAND with WEIGHTSYNC_EVICT_FILE set; when the run ended on a divergence (exit_code=17 "
        "on every rank) exit with that status even though torchrun exits 1, and leave the evict file naming the "
        "hosts to leave out (docs/restarts.md).",
        epilog="example:\n  weightsync-audit launch --evict-file evict.json -- torchrun --nproc_per_node=8 "
        "--max-restarts=1 train.py\n",
    )
    p.add_argument("--evict-file", default=None, help="the JSON evict file (default ./weightsync-evict.json)")
    p.add_argument("--segment-health-dir", default=None, help="NVRx ft_launcher's --ft-segment-health-check-dir")
    p.add_argument("launched", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the launcher and its arguments")


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "launch":
        from weightsync_audit.cli.launch import cmd_launch

        return cmd_launch(args.launched, evict_file=args.evict_file, segment_health_dir=args.segment_health_dir)
    if args.command == "check":
        from weightsync_audit.cli._reports import cmd_check

        return cmd_check(
            args.report, as_json=args.json, allow_torn=args.allow_torn, accept_repaired=args.accept_repaired
        )
    if args.command == "show":
        from weightsync_audit.cli._reports import cmd_show

        return cmd_show(args.report, plot=args.plot, by=args.by, allow_torn=args.allow_torn)
    if args.command == "diff":
        from weightsync_audit.cli._diff import cmd_diff

        if args.atol is not None and not args.atol >= 0:
            raise CliError(f"--atol {args.atol}: must be a number >= 0")
        return cmd_diff(
            args.a,
            args.b,
            atol=args.atol,
            exclude=args.exclude,
            limit=max(0, args.limit),
            as_json=args.json,
            sidecars=not args.full and args.atol is None and not args.exclude,
        )
    if args.command == "verify":
        from weightsync_audit.cli._verify import cmd_verify

        return cmd_verify(args.path, as_json=args.json)
    if args.command == "demo":
        from weightsync_audit.cli._demo import run_demo

        return run_demo(ranks=args.ranks, epochs=args.epochs, report_dir=args.report)
    raise AssertionError(args.command)


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
        return _dispatch(args)
    except CliError as exc:
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
