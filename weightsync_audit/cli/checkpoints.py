"""``diff A [B]`` and ``verify PATH``: the commands that read checkpoints (``engine/checkpoints/``), by the one
folder reader (``folder.folder_units``), with the same words and exit codes for the same file: 0 identical or
verified, 1 differs, changed or unverified, 2 bad input (no checkpoint, unreadable alone, refused, leading
outside its folder). Both show a progress bar (bytes) on a terminal for work that lasts over a second, and
nothing extra in a pipe. :data:`DIFF` and :data:`VERIFY` are the commands."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from types import SimpleNamespace
from typing import Callable, Iterator, Sequence

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from weightsync_audit.cli import EXIT_DIFFERENT, EXIT_OK, CliError, add_json
from weightsync_audit.reporting.render import log_console
from weightsync_audit.text import fmt_gap

__all__ = ["DIFF", "VERIFY", "cmd_diff", "cmd_verify", "progress_bar", "sidecar_diff"]


@contextlib.contextmanager
def progress_bar(paths: Sequence[str | None], what: str) -> Iterator[Callable[[int], None] | None]:
    """A callback for the bytes read, drawing a bar on stderr once the work has lasted a second, when stderr
    is a terminal; ``None`` (nothing drawn) in a pipe."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from weightsync_audit.engine.checkpoints.folder import checkpoint_files

    try:  # both sides' bytes: diff and verify read each about once
        total = sum(f.stat().st_size for p in paths if p for f in checkpoint_files(p).values())
    except (OSError, ValueError):
        total = None
    bar = Progress(TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True,
                   console=Console(stderr=True))  # fmt: skip
    start, done, task = time.monotonic(), 0, None

    def tick(n: int) -> None:
        nonlocal done, task
        done += n
        if task is None and time.monotonic() - start >= 1.0:
            bar.start()
            task = bar.add_task(what, total=total)
        if task is not None:
            bar.update(task, completed=min(done, total or done))

    try:
        yield tick
    finally:
        if task is not None:
            bar.stop()


def _diff_arguments(p: argparse.ArgumentParser) -> None:
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
    add_json(p, "the comparison")
    p.add_argument("--full", action="store_true", help="load the files even when both sides have a sidecar")


def _run_diff(args: argparse.Namespace) -> int:
    """Compare the checkpoints: by their sidecars when both have one (unless ``--full``, ``--atol`` or
    ``--exclude`` ask for the tensors), else tensor by tensor."""
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


_STYLE = {
    "missing": "red",
    "extra": "blue",
    "shape": "magenta",
    "dtype": "magenta",
    "values": "yellow",
    "bytes": "yellow",
    "unreadable": "red",
}


def cmd_diff(
    a: str,
    b: str | None,
    *,
    atol: float | None = None,
    exclude: Sequence[str] = (),
    limit: int = 50,
    as_json: bool = False,
    console: Console | None = None,
    sidecars: bool = False,
) -> int:
    """Compare checkpoints; 0 identical, 1 different, 2 unreadable or refused. With ``sidecars``, two
    checkpoints that both have a weightsync sidecar are compared by their digests, without loading them."""
    from weightsync_audit.engine.checkpoints.diff import diff_checkpoints

    if sidecars and b is not None:
        code = sidecar_diff(a, b, console or Console(soft_wrap=True), as_json)
        if code is not None:
            return code
    with progress_bar([a, b], "diff") as tick:
        result = diff_checkpoints(a, b, atol=atol, exclude=exclude, progress=tick)
    console = console or log_console()
    code = EXIT_OK if result.identical else EXIT_DIFFERENT
    if as_json:
        console.file.write(json.dumps(result.to_dict(), indent=2) + "\n")
        return code
    for pair in result.pairs:
        title = f"{pair.a or '(none)'}  vs  {pair.b or '(none)'}"
        if pair.a is None or pair.b is None:
            console.print(Text(f"{title}: {pair.note}", style="bold red"))
            continue
        if pair.note:
            console.print(Text(pair.note, style="dim"))
        if pair.exact:
            console.print(Text(f"IDENTICAL: {title}: all {pair.compared} entries equal", style="bold green"))
            continue
        if pair.identical:
            worst = max(e.max_abs_diff or 0.0 for e in pair.within_atol)
            console.print(
                Text(
                    f"EQUAL within atol {atol:g}: {title}: {len(pair.within_atol)} of {pair.compared} entries differ, "
                    f"all within atol (largest max |diff| {fmt_gap(worst)}); the others have equal bits",
                    style="bold green",
                )
            )
            continue
        said = ", ".join(f"{n} {s}" for s, n in Counter(e.status for e in pair.entries).items())
        console.print(
            Text(f"DIFFERENT: {title}: {said}; {pair.same} of {pair.compared} shared entries equal", style="bold red")
        )
        table = Table(header_style="bold", box=box.SIMPLE_HEAD)
        widest = max(len(e.name) for e in pair.entries[:limit]) if pair.entries[:limit] else 4
        for col, kw in (
            ("name", {"style": "cyan", "overflow": "fold", "min_width": min(40, widest)}),
            ("what", {}),
            ("A", {}),
            ("B", {}),
            ("max |diff|", {"justify": "right"}),
            ("changed", {"justify": "right"}),
        ):
            table.add_column(col, **kw)
        for e in pair.entries[:limit]:
            changed = "-" if e.changed is None else f"{e.changed}/{e.numel}"
            table.add_row(
                escape(e.name),
                Text(e.status, style=_STYLE[e.status]),
                escape(e.a or "-"),
                escape(e.b or "-"),
                fmt_gap(e.max_abs_diff),
                changed,
            )
        console.print(table)
        if len(pair.entries) > limit:
            console.print(Text(f"... and {len(pair.entries) - limit} more (--limit N, or --json for all)", style="dim"))
    return code


def sidecar_diff(a: str, b: str, console: Console, as_json: bool = False) -> int | None:
    """``diff`` by the sidecars when both sides have one (no file is loaded; each file's bytes are checked
    against its sidecar's size and digest); ``None`` when the files must be compared instead (either has no
    sidecar, or one that cannot identify its files: said in a note)."""
    from weightsync_audit.engine.checkpoints.offline import diff_sidecars

    compared = diff_sidecars(a, b)
    if compared is None:
        return None
    if compared.why_not is not None:
        if not as_json:
            console.print(Text(f"note: not compared by sidecars: {compared.why_not}; comparing the files", "dim"))
        return None
    rows = compared.rows
    code = EXIT_OK if compared.identical else EXIT_DIFFERENT
    if as_json:
        entries = [{"name": n, "status": s} for n, s in rows]
        console.file.write(json.dumps({"by": "sidecars", "entries": entries, "stale": compared.stale}) + "\n")
        return code
    title = f"{a}  vs  {b} (by their sidecars; --full loads the files)"
    if compared.stale:
        console.print(
            Text(
                f"STALE SIDECAR: {title}: {len(compared.stale)} file(s) no longer match what their sidecar identifies, "
                "so the sidecars say nothing of what they hold now; compare the files with --full",
                style="bold red",
            ),
            soft_wrap=True,
        )
        for line in compared.stale[:50]:
            console.print(f"  {escape(line)}", soft_wrap=True)
    elif not rows:
        console.print(
            Text(f"IDENTICAL: {title}: all {compared.count} tensors have equal digests", style="bold green"),
            soft_wrap=True,
        )
    if rows:
        console.print(Text(f"DIFFERENT: {title}: {len(rows)} tensor(s)", style="bold red"), soft_wrap=True)
        for n, s in rows[:50]:
            console.print(f"  {escape(n)}  {s}", soft_wrap=True)
    return code


DIFF = SimpleNamespace(
    SUMMARY="compare two checkpoints tensor by tensor; exit 0 identical, 1 different, 2 error",
    DESCRIPTION="""
    Compare checkpoints tensor by tensor: Lightning .ckpt files, torch.save'd state dicts, or folders of per-rank
    files. Reports missing, extra, shape and dtype changes, and values with their max |diff|. Files are loaded with
    torch.load(weights_only=True): one that needs code to load is refused (exit 2), never executed; a file that is
    no checkpoint at all (a report, a text) is named as such (exit 2). With one folder, every file in it is compared
    with the first. With --atol, tensors that differ within it are 'EQUAL within atol' (exit 0), told apart from
    IDENTICAL (equal bits).
""",
    EXAMPLES="""
    examples:
      weightsync-audit diff epoch=3.ckpt epoch=3-rerun.ckpt
      weightsync-audit diff ckpts/rank0.pt ckpts/rank1.pt --atol 1e-6
      weightsync-audit diff ckpts/                  # every rank's file against the first
      weightsync-audit diff a.ckpt b.ckpt --exclude 'loops.*' --exclude 'callbacks.*'
""",
    add_arguments=_diff_arguments,
    run=_run_diff,
)


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="checkpoint file or folder")
    add_json(p, "the outcome")


_NOT_VERIFIED = (
    ("changed_files", "file(s) changed since saved"),
    ("missing_files", "file(s) missing"),
    ("added_files", "file(s) added since saved (a resume may read them)"),
    ("changed", "changed since saved"),
    ("missing", "missing"),
)
"""What ``verify`` names of a checkpoint that is not as saved, in this order (its outcome's key, the words)."""


def cmd_verify(path: str, *, as_json: bool = False, console: Console | None = None) -> int:
    """``weightsync-audit verify PATH``: 0 verified and unchanged, 1 not, 2 unreadable."""
    from weightsync_audit.engine.checkpoints.offline import verify_checkpoint

    with progress_bar([path], "verify") as tick:
        outcome = verify_checkpoint(path, progress=tick)
    resume = outcome.get("resume") or {"status": "unchecked", "findings": []}
    code = EXIT_OK if outcome["status"] == "verified" and resume["status"] != "differs" else EXIT_DIFFERENT
    console = console or Console(soft_wrap=True)
    if as_json:
        console.file.write(json.dumps(outcome, indent=2) + "\n")
        return code
    where = f"{path} (step {outcome.get('step')})"
    status = outcome["status"]
    for f in resume["findings"]:  # one line per thing a resume would not give back, naming the ranks
        style = "bold red" if f.get("severity", "error") != "note" else "yellow"
        console.print(Text(f"RESUME: {path}: {f['detail']}", style=style))
    if status == "verified" and resume["status"] == "differs":
        console.print(Text(f"NOT VERIFIED: {where}: the weights agree; the resume state above does not"))
    elif status == "verified":
        console.print(Text(f"VERIFIED: {where}: every replica agreed when it was saved; unchanged since", "bold green"))
        if outcome.get("not_compared"):
            part = outcome["not_compared"]
            console.print(
                f"  {len(part)} partitioned tensor(s) not compared ({escape(', '.join(part[:5]))}"
                f"{', ...' if len(part) > 5 else ''}): the engine saved them as each rank's partition, in its "
                "optimizer files (a placeholder in the model file)"
            )
    elif status == "unverified":
        console.print(Text(f"UNVERIFIED: {path}: {outcome['why']}", style="bold yellow"))
    else:
        said = [f"{what}: {', '.join(outcome[key][:10])}" for key, what in _NOT_VERIFIED if outcome.get(key)]
        if outcome["missing"] and outcome.get("skipped"):
            said.append(f"not read (they need code to load): {', '.join(outcome['skipped'][:5])}")
        if outcome.get("diverged") is not None:
            said.append(f"saved while the replicas differed ({', '.join(outcome['diverged'][:5]) or 'see its record'})")
        console.print(Text(f"NOT VERIFIED: {where}: " + "; ".join(said), style="bold red"))
    if outcome.get("files") == "unidentified":
        console.print(
            Text(
                f"note: {path}: its sidecar (written by an earlier version) does not identify the checkpoint's files "
                "(size and digest): their bytes were not checked, only the tensors it records",
                style="yellow",
            )
        )
    return code


VERIFY = SimpleNamespace(
    SUMMARY="check a checkpoint against its sidecar; exit 0 verified and unchanged, 1 not, 2 unreadable",
    DESCRIPTION="""
    Check a checkpoint (a file, a Hugging Face checkpoint folder, a DeepSpeed or torch.distributed.checkpoint
    folder) against the sidecar weightsync wrote when it was saved: exit 0 when the replicas agreed at that step and
    every file (size and digest) and every tensor still is as saved, 1 when it has no sidecar, was saved while the
    replicas differed, or changed since (naming the files, tensors or shards and their ranks), 2 when unreadable, a
    sidecar is malformed (naming the field) or a file would need code to load (refused, never run).
""",
    EXAMPLES="""
    example:
      weightsync-audit verify checkpoints/epoch=3-step=400.ckpt
""",
    add_arguments=_verify_arguments,
    run=lambda args: cmd_verify(args.path, as_json=args.json),
)
