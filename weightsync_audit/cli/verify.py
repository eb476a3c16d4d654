"""``verify PATH``: a checkpoint against its sidecar, on one machine (``engine/checkpoints/offline.py``).

Exit 0: the sidecar says every replica agreed when it was saved (``verified``), every file of the checkpoint
still has the size and digest it had then and every tensor (every shard file, for a
``torch.distributed.checkpoint`` folder) the digest it had then. Exit 1: no sidecar (unverified), saved while
the replicas differed, or changed since (the files, tensors or shards are named). Exit 2: the checkpoint or
its sidecar cannot be read (a malformed sidecar: the field is named), or a file of it would need code to
load (refused, never run).
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from weightsync_audit.cli.command import EXIT_DIFFERENT, EXIT_OK, add_json

__all__ = ["DESCRIPTION", "EXAMPLES", "SUMMARY", "add_arguments", "cmd_verify", "run"]


SUMMARY = "check a checkpoint against its sidecar; exit 0 verified and unchanged, 1 not, 2 unreadable"

DESCRIPTION = """
    Check a checkpoint (a file, a Hugging Face checkpoint folder, a DeepSpeed or torch.distributed.checkpoint
    folder) against the sidecar weightsync wrote when it was saved: exit 0 when the replicas agreed at that step and
    every file (size and digest) and every tensor still is as saved, 1 when it has no sidecar, was saved while the
    replicas differed, or changed since (naming the files, tensors or shards and their ranks), 2 when unreadable, a
    sidecar is malformed (naming the field) or a file would need code to load (refused, never run).
"""

EXAMPLES = """
    example:
      weightsync-audit verify checkpoints/epoch=3-step=400.ckpt
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``verify``'s arguments."""
    p.add_argument("path", metavar="PATH", help="checkpoint file or folder")
    add_json(p, "the outcome")


def run(args: argparse.Namespace) -> int:
    """Verify the checkpoint; its exit code."""
    return cmd_verify(args.path, as_json=args.json)


def cmd_verify(path: str, *, as_json: bool = False, console: Console | None = None) -> int:
    """``weightsync-audit verify PATH``: 0 verified and unchanged, 1 not, 2 unreadable."""
    from weightsync_audit.engine.checkpoints.offline import verify_checkpoint

    outcome = verify_checkpoint(path)
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
        said = []
        if outcome.get("changed_files"):
            said.append(f"file(s) changed since saved: {', '.join(outcome['changed_files'][:10])}")
        if outcome.get("missing_files"):
            said.append(f"file(s) missing: {', '.join(outcome['missing_files'][:10])}")
        if outcome.get("added_files"):
            said.append(f"file(s) added since saved (a resume may read them): {', '.join(outcome['added_files'][:10])}")
        if outcome["changed"]:
            said.append(f"changed since saved: {', '.join(outcome['changed'][:10])}")
        if outcome["missing"]:
            said.append(f"missing: {', '.join(outcome['missing'][:10])}")
            if outcome.get("skipped"):
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
