"""``verify PATH``: a checkpoint against its sidecar, on one machine; and the sidecar side of ``diff``.

Exit 0: the sidecar says every replica agreed when it was saved (``verified``) and every tensor (every
shard file, for a ``torch.distributed.checkpoint`` folder) still has the digest it had then. Exit 1: no
sidecar (unverified), saved while the replicas differed, or changed since (the tensors or shards are
named). Exit 2: the checkpoint or its sidecar cannot be read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from weightsync_audit.cli._summary import EXIT_DIFFERENT, EXIT_OK, CliError
from weightsync_audit.cli.checkpoint_diff import CHECKPOINT_SUFFIXES, CheckpointError, load_checkpoint
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


def _folder_tensors(folder: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in sorted(folder.iterdir()):
        if not f.is_file() or f.name.startswith(_SKIPPED):
            continue
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            out.update(load_file(str(f)))
        elif f.suffix in CHECKPOINT_SUFFIXES:
            obj = load_checkpoint(f)
            out.update(obj if isinstance(obj, dict) and all(isinstance(k, str) for k in obj) else {f.name: obj})
    return out


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
    if sidecar is None:
        return {**out, "status": "unverified", "why": f"no sidecar ({sidecar_path(p).name})"}
    out.update(step=sidecar.get("step"), world_size=sidecar.get("world_size"), saved=sidecar["verdict"])
    if "shards" in sidecar:
        now = dcp_shards(p)
        for f, s in sorted(sidecar["shards"].items()):
            if f not in now:
                out["missing"].append(f"{f} (rank {s['rank']})")
            elif now[f]["digest"] != s["digest"]:
                out["changed"].append(f"{f} (rank {s['rank']})")
    else:
        try:
            loaded = _folder_tensors(p) if p.is_dir() else load_checkpoint(p)
        except CheckpointError as exc:
            raise CliError(str(exc)) from None
        now = tensor_digests(loaded)
        present = {e["digest"] for e in now.values()}
        for n, e in sorted(sidecar["tensors"].items()):
            if n not in now:
                if not (p.is_dir() and e["digest"] in present):  # a tied weight saved once in a folder
                    out["missing"].append(n)
            elif (now[n]["digest"], now[n]["shape"], now[n]["dtype"]) != (e["digest"], e["shape"], e.get("dtype")):
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
    return {**out, "status": status}


def cmd_verify(path: str, *, as_json: bool = False, console: Console | None = None) -> int:
    """``weightsync-audit verify PATH``: 0 verified and unchanged, 1 not, 2 unreadable."""
    outcome = verify_checkpoint(path)
    code = EXIT_OK if outcome["status"] == "verified" else EXIT_DIFFERENT
    console = console or Console(soft_wrap=True)
    if as_json:
        console.file.write(json.dumps(outcome, indent=2) + "\n")
        return code
    where = f"{path} (step {outcome.get('step')})"
    status = outcome["status"]
    if status == "verified":
        console.print(Text(f"VERIFIED: {where}: every replica agreed when it was saved; unchanged since", "bold green"))
    elif status == "unverified":
        console.print(Text(f"UNVERIFIED: {path}: {outcome['why']}", style="bold yellow"))
    else:
        said = []
        if outcome["changed"]:
            said.append(f"changed since saved: {', '.join(outcome['changed'][:10])}")
        if outcome["missing"]:
            said.append(f"missing: {', '.join(outcome['missing'][:10])}")
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
