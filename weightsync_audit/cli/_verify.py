"""``verify PATH``: a checkpoint against its sidecar, on one machine; and the sidecar side of ``diff``.

Exit 0: the sidecar says every replica agreed when it was saved (``verified``) and every tensor (every
shard file, for a ``torch.distributed.checkpoint`` folder) still has the digest it had then. Exit 1: no
sidecar (unverified), saved while the replicas differed, or changed since (the tensors or shards are
named). Exit 2: the checkpoint or its sidecar cannot be read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from weightsync_audit.cli._summary import EXIT_DIFFERENT, EXIT_OK, CliError
from weightsync_audit.cli.checkpoint_diff import CHECKPOINT_SUFFIXES, CheckpointError, load_checkpoint
from weightsync_audit.cli.checkpoint_load import UnsafeCheckpointError
from weightsync_audit.cli.verify_resume import verify_resume
from weightsync_audit.engine.checkpoints.sidecar import (
    SidecarError,
    dcp_shards,
    read_sidecar,
    sidecar_path,
    tensor_digests,
)

__all__ = ["cmd_verify", "sidecar_diff", "verify_checkpoint"]

_SKIPPED = ("training_args.bin", "rng_state")
"""Files of a checkpoint folder that hold no tensors the sidecar records (Hugging Face's own)."""


def _folder_files(folder: Path) -> list[Path]:
    """The files of a checkpoint folder that may hold tensors: its own, and those under the tag that its
    ``latest`` file names (a DeepSpeed ``save_checkpoint`` folder: ``<tag>/mp_rank_00_model_states.pt``)
    or, without one, under every subfolder."""
    files = [f for f in sorted(folder.iterdir()) if f.is_file()]
    subdirs = [d for d in sorted(folder.iterdir()) if d.is_dir()]
    latest = folder / "latest"
    if latest.is_file():
        try:
            tag = latest.read_text().strip()
        except (OSError, UnicodeDecodeError):
            tag = ""
        if tag and (folder / tag).is_dir():
            subdirs = [folder / tag]
    for d in subdirs:
        files += sorted(f for f in d.rglob("*") if f.is_file())
    return [f for f in files if not f.name.startswith(_SKIPPED)]


def _prefix_in(keys: Mapping[str, Any], wanted: list[str]) -> str:
    """The prefix under which most of ``wanted`` sit among ``keys`` (``""`` when none do)."""
    cands = {""}
    for n in wanted[:8]:
        cands |= {k[: len(k) - len(n)] for k in keys if k.endswith(n) and (len(k) == len(n) or k[-len(n) - 1] in "./")}
    return max(sorted(cands), key=lambda p: sum(p + n in keys for n in wanted))


def _folder_digests(folder: Path, wanted: list[str], out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Name (as in the sidecar) -> digest entry of every tensor found in the folder's files, each file's
    names matched to the sidecar's under the prefix they sit at there (``module.`` in a DeepSpeed model
    file). A file that would need code to load is skipped and listed in ``out["skipped"]``."""
    found: dict[str, dict[str, Any]] = {}
    for f in _folder_files(folder):
        try:
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file

                obj: Any = load_file(str(f))
            elif f.suffix in CHECKPOINT_SUFFIXES:
                obj = load_checkpoint(f)
            else:
                continue
        except UnsafeCheckpointError:
            out["skipped"].append(str(f.relative_to(folder)))
            continue
        digests = tensor_digests(obj)
        prefix = _prefix_in(digests, [n for n in wanted if n not in found])
        for n in wanted:
            if n not in found and prefix + n in digests:
                found[n] = digests[prefix + n]
    return found


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """The outcome of checking ``path`` against its sidecar: ``status`` (``verified``, ``unverified``,
    ``diverged``, ``changed``), ``changed`` (names, or shard files with their ``rank``), ``missing``.

    Raises :class:`CliError` when the checkpoint or its sidecar cannot be read.
    """
    p = Path(path)
    if not p.exists():
        raise CliError(f"{p}: no such file or folder")
    try:
        sidecar = read_sidecar(p)
    except SidecarError as exc:
        raise CliError(str(exc)) from None
    out: dict[str, Any] = {"path": str(p), "sidecar": str(sidecar_path(p)), "changed": [], "missing": []}
    out["skipped"] = []
    if sidecar is None:
        return {**out, "status": "unverified", "why": f"no sidecar ({sidecar_path(p).name})"}
    out.update(step=sidecar.get("step"), world_size=sidecar.get("world_size"), saved=sidecar["verdict"])
    out["not_compared"] = list(sidecar.get("partitioned") or [])  # saved as each rank's partition only
    if "shards" in sidecar:
        now = dcp_shards(p)
        for f, s in sorted(sidecar["shards"].items()):
            if f not in now:
                out["missing"].append(f"{f} (rank {s['rank']})")
            elif now[f]["digest"] != s["digest"]:
                out["changed"].append(f"{f} (rank {s['rank']})")
    else:
        saved = sidecar["tensors"]
        try:
            now = _folder_digests(p, sorted(saved), out) if p.is_dir() else tensor_digests(load_checkpoint(p))
        except CheckpointError as exc:
            raise CliError(str(exc)) from None
        tied = sidecar.get("tied") or {}
        partitioned = bool(sidecar.get("partitioned"))
        for n, e in sorted(saved.items()):
            held = now.get(n)
            if held is None and tied.get(n) in now and saved.get(tied[n], {}).get("digest") == e["digest"]:
                held = now[tied[n]]  # saved once for both names (tied weights), as the sidecar recorded
            if held is None:
                out["missing"].append(n)
            elif partitioned and not math.prod(held["shape"]) and math.prod(e["shape"]):
                out["not_compared"].append(n)  # ZeRO-3 saves every parameter as a placeholder in the model file
            elif (held["digest"], held["shape"], held["dtype"]) != (e["digest"], e["shape"], e.get("dtype")):
                out["changed"].append(n)
    verdict = sidecar["verdict"]
    if out["changed"] or out["missing"]:
        status = "changed"
    elif verdict == "sampled":  # agreed on a slice only: nothing says the other bytes did
        status = "unverified"
        out["why"] = (
            f"saved after a sampled audit (coverage {sidecar.get('coverage')}), which did not compare every byte"
        )
    else:
        status = "verified" if verdict == "verified" else "diverged"
    if verdict == "diverged":
        out["diverged"] = sidecar.get("diverged", [])
    out["resume"] = verify_resume(p, sidecar)  # each rank's own RNG, position, schedulers (cli/verify_resume.py)
    return {**out, "status": status}


def cmd_verify(path: str, *, as_json: bool = False, console: Console | None = None) -> int:
    """``weightsync-audit verify PATH``: 0 verified and unchanged, 1 not, 2 unreadable."""
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
        if outcome["changed"]:
            said.append(f"changed since saved: {', '.join(outcome['changed'][:10])}")
        if outcome["missing"]:
            said.append(f"missing: {', '.join(outcome['missing'][:10])}")
            if outcome.get("skipped"):
                said.append(f"not read (they need code to load): {', '.join(outcome['skipped'][:5])}")
        if outcome.get("diverged") is not None:
            said.append(f"saved while the replicas differed ({', '.join(outcome['diverged'][:5]) or 'see its record'})")
        console.print(Text(f"NOT VERIFIED: {where}: " + "; ".join(said), style="bold red"))
    return code


def sidecar_diff(a: str, b: str, console: Console, as_json: bool = False) -> int | None:
    """``diff`` by the sidecars when both sides have one (no file is loaded); ``None`` when either has none."""
    try:
        sa, sb = read_sidecar(a), read_sidecar(b)
    except SidecarError:
        return None
    if sa is None or sb is None or "shards" in sa or "shards" in sb:
        return None
    ta, tb = sa["tensors"], sb["tensors"]
    rows = [(n, "missing") for n in sorted(set(ta) - set(tb))] + [(n, "extra") for n in sorted(set(tb) - set(ta))]
    rows += [(n, "values") for n in sorted(set(ta) & set(tb)) if ta[n] != tb[n]]
    code = EXIT_DIFFERENT if rows else EXIT_OK
    if as_json:
        console.file.write(
            json.dumps({"by": "sidecars", "entries": [{"name": n, "status": s} for n, s in rows]}) + "\n"
        )
        return code
    title = f"{a}  vs  {b} (by their sidecars; --full loads the files)"
    if not rows:
        console.print(
            Text(f"IDENTICAL: {title}: all {len(ta)} tensors have equal digests", style="bold green"), soft_wrap=True
        )
    else:
        console.print(Text(f"DIFFERENT: {title}: {len(rows)} tensor(s)", style="bold red"), soft_wrap=True)
        for n, s in rows[:50]:
            console.print(f"  {escape(n)}  {s}", soft_wrap=True)
    return code
