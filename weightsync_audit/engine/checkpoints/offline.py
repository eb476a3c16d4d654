"""What ``weightsync-audit verify`` checks of a checkpoint on one machine, with no rank running.

:func:`verify_checkpoint`: the sidecar says every replica agreed when it was saved (``verified``), every
file of the checkpoint still has the size and digest it had then (the sidecar's ``files``: a DCP folder's
``.metadata`` and shards, every file of a Hugging Face or DeepSpeed folder) and every tensor the digest it
had then; else it names the files, tensors or shards (and their ranks) that changed or are missing. Every
file is read through :mod:`~weightsync_audit.engine.checkpoints.load`: one that would need code to load is
refused, never run.

:func:`verify_resume`, from the sidecar's ``resume``: what the checkpoint will give each rank:

- what is meant to be equal on every replica (lr schedulers, the grad scaler) was equal when saved;
- a Hugging Face folder's ``rng_state_{rank}.pth`` files still hold each rank's *own* saved RNG state
  (``rank 1's rng_state_1.pth holds rank 0's RNG state``: the file a resume of rank 1 would load);
- its ``trainer_state.json`` resumes at the step the sidecar saved, and its ``scheduler.pt`` is there.

>>> verify_resume(Path("."), {})["status"]
'unchecked'
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from weightsync_audit.engine.checkpoints.diff import CHECKPOINT_SUFFIXES
from weightsync_audit.engine.checkpoints.files import checkpoint_files, dcp_shards, file_changes
from weightsync_audit.engine.checkpoints.load import load_checkpoint, load_tensors, read_json
from weightsync_audit.engine.checkpoints.resume_state import compare, is_error, rng_file_state, saved_differences
from weightsync_audit.engine.checkpoints.sidecar import read_sidecar, sidecar_path, tensor_digests
from weightsync_audit.errors import CheckpointError, UnsafeCheckpointError

__all__ = ["verify_checkpoint", "verify_resume"]


def _rng_files(folder: Path, saved: Mapping[str, Any]) -> list[dict[str, Any]]:
    names = {r: f"rng_state_{r}.pth" if len(saved) > 1 else "rng_state.pth" for r in saved}
    present = {r: folder / n for r, n in names.items() if (folder / n).is_file()}
    if not present:
        return []
    missing = sorted(int(r) for r in names if r not in present)
    out: list[dict[str, Any]] = []
    if missing:
        out.append({
            "component": "rng", "kind": "not_restored", "ranks": missing, "from_ranks": [],
            "detail": f"rank(s) {', '.join(map(str, missing))} have no RNG file ({names[str(missing[0])]}): "
            "the Trainer will not restore their RNG state",
        })  # fmt: skip
    now = {r: rng_file_state(str(p)) for r, p in present.items()}
    mine = {r: saved[r] for r in present}
    for f in compare(mine, now):
        f["detail"] = f["detail"].replace("resumed with", "would resume with") + " (its rng_state file)"
        out.append(f)
    return out


def _trainer_step(folder: Path, saved: Mapping[str, Any]) -> list[dict[str, Any]]:
    state = folder / "trainer_state.json"
    if not state.is_file():
        return []
    try:
        doc = read_json(state, "trainer state")
    except CheckpointError:  # unreadable: the resume cannot start either, which verify does not judge here
        return []
    step = doc.get("global_step") if isinstance(doc, dict) else None
    was = {r: (e.get("data.position", {}).get("value") or {}).get("step") for r, e in saved.items()}
    odd = sorted(int(r) for r, s in was.items() if s is not None and s != step)
    if not odd:
        return []
    return [{
        "component": "data.position", "kind": "not_restored", "ranks": odd, "from_ranks": [],
        "detail": f"trainer_state.json resumes at step {step}, the ranks saved step {was[str(odd[0])]}",
    }]  # fmt: skip


def verify_resume(path: Path, sidecar: Mapping[str, Any]) -> dict[str, Any]:
    """``{"status": exact|differs|unchecked, "findings", "why"?}`` for the checkpoint at ``path``."""
    resume = sidecar.get("resume") if isinstance(sidecar, Mapping) else None
    saved = resume.get("ranks") if isinstance(resume, Mapping) else None
    if not isinstance(saved, dict) or not saved:
        return {"status": "unchecked", "findings": [], "why": "the sidecar holds no resume state"}
    findings = saved_differences(saved)
    if path.is_dir():
        findings += _rng_files(path, saved) + _trainer_step(path, saved)
        hf = (path / "trainer_state.json").is_file()
        if hf and any("lr_scheduler" in e for e in saved.values()) and not (path / "scheduler.pt").is_file():
            findings.append({
                "component": "lr_scheduler", "kind": "not_restored", "ranks": sorted(map(int, saved)),
                "from_ranks": [], "detail": "scheduler.pt is missing: the lr scheduler would restart at step 0",
            })  # fmt: skip
    return {"status": "differs" if any(is_error(f) for f in findings) else "exact", "findings": findings}


_SKIPPED = ("training_args.bin", "rng_state")
"""Files of a checkpoint folder that hold no tensors the sidecar records (Hugging Face's own): covered by
``files``, never loaded for tensors (``training_args.bin`` needs code; the RNG files are read by
:func:`verify_resume`)."""

TENSOR_SUFFIXES = (*CHECKPOINT_SUFFIXES, ".safetensors")


def _best_prefix(digests: Mapping[str, Any], wanted: Mapping[str, Any]) -> str:
    """The prefix under which ``wanted`` (a sidecar's names) sit among ``digests`` (a file's): where most of
    them are found, and among those, where most have the digest saved (a file holding the model twice,
    ``model.`` and ``ema.``, is read where the saved model is)."""
    names = list(wanted)
    cands = {""}
    for n in names[:8]:
        cands |= {
            k[: len(k) - len(n)] for k in digests if k.endswith(n) and (len(k) == len(n) or k[-len(n) - 1] in "./")
        }

    def score(p: str) -> tuple[int, int]:
        held = [n for n in names if p + n in digests]
        return len(held), sum(digests[p + n]["digest"] == wanted[n]["digest"] for n in held)

    return max(sorted(cands), key=score)


def _match(digests: Mapping[str, Any], saved: Mapping[str, Any], found: dict[str, Any]) -> None:
    """Add to ``found`` (sidecar name -> digest entry) the names of ``saved`` not found yet that ``digests``
    (one file's tensors) holds, under the prefix they sit at there (``module.`` in a DeepSpeed model file,
    ``model.`` in ``torch.save({"model": model.state_dict()})``)."""
    wanted = {n: e for n, e in saved.items() if n not in found}
    prefix = _best_prefix(digests, wanted)
    found.update({n: digests[prefix + n] for n in wanted if prefix + n in digests})


def _folder_digests(folder: Path, saved: Mapping[str, Any], out: dict[str, Any], as_saved: set[str] | None) -> Any:
    """Name (as in the sidecar) -> digest entry of every saved tensor found in the folder's files, read in
    name order until every one is found. A file that would need code to load is refused
    (:class:`UnsafeCheckpointError`), unless it is one ``as_saved`` names (its bytes are those identified at
    the save: the engine's own, such as DeepSpeed's optimizer files), then it is listed in ``out["skipped"]``;
    with a sidecar that identifies no file (``as_saved`` is ``None``), listed likewise, as before."""
    found: dict[str, dict[str, Any]] = {}
    for name, f in checkpoint_files(folder).items():
        if len(found) == len(saved):
            break
        if f.name.startswith(_SKIPPED) or f.suffix not in TENSOR_SUFFIXES:
            continue
        try:
            obj = load_tensors(f)
        except UnsafeCheckpointError:
            if as_saved is not None and name not in as_saved:
                raise
            out["skipped"].append(name)
            continue
        _match(tensor_digests(obj), saved, found)
    return found


def _check_files(p: Path, sidecar: Mapping[str, Any], out: dict[str, Any]) -> set[str] | None:
    """The files of ``p`` against the sidecar's ``files`` (DCP shards against ``shards``, naming their
    rank) into ``out``; the names of the files still as saved (``None``: the sidecar identifies none)."""
    shards = sidecar.get("shards") or {}
    if shards:
        now = dcp_shards(p)
        for f, s in sorted(shards.items()):
            if f not in now:
                out["missing"].append(f"{f} (rank {s['rank']})")
            elif now[f]["digest"] != s["digest"]:
                out["changed"].append(f"{f} (rank {s['rank']})")
    files = sidecar.get("files")
    if files is None:  # a sidecar of an earlier version: the tensors are checked, the files unidentified
        out["files"] = "unidentified"
        if shards and not (p / ".metadata").is_file():  # what dcp.load reads first
            out["missing_files"].append(".metadata")
        return None
    out["files"] = "identified"
    now = file_changes(p, files, skip=shards)
    out["changed_files"] += now.changed
    out["missing_files"] += now.missing
    out["added_files"] += now.added
    gone = {c.split(" (", 1)[0] for c in now.changed} | set(now.missing)
    return {f for f in files if f not in gone}


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """The outcome of checking ``path`` against its sidecar: ``status`` (``verified``, ``unverified``,
    ``diverged``, ``changed``), ``changed`` (names, or shard files with their ``rank``), ``missing``,
    ``changed_files``, ``missing_files`` and ``added_files`` (the files no longer as saved: ``files``), ``files``
    (``identified``, or ``unidentified`` for a sidecar of an earlier version that names none).

    Raises :class:`CheckpointError` when the checkpoint or its sidecar cannot be read, or a file of it would
    need code to load (:class:`UnsafeCheckpointError`, never loaded).
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    sidecar = read_sidecar(p)
    out: dict[str, Any] = {"path": str(p), "sidecar": str(sidecar_path(p)), "changed": [], "missing": []}
    out.update(changed_files=[], missing_files=[], added_files=[], skipped=[])
    if sidecar is None:
        return {**out, "status": "unverified", "why": f"no sidecar ({sidecar_path(p).name})"}
    out.update(step=sidecar.get("step"), world_size=sidecar.get("world_size"), saved=sidecar["verdict"])
    out["not_compared"] = list(sidecar.get("partitioned") or [])  # saved as each rank's partition only
    as_saved = _check_files(p, sidecar, out)
    if "shards" not in sidecar:
        saved = sidecar["tensors"]
        now: dict[str, Any] = {}
        if p.is_dir():
            now = _folder_digests(p, saved, out, as_saved)
        else:
            _match(tensor_digests(load_checkpoint(p)), saved, now)
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
    if any(out[k] for k in ("changed", "missing", "changed_files", "missing_files", "added_files")):
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
    out["resume"] = verify_resume(p, sidecar)  # each rank's own RNG, position, schedulers (below)
    return {**out, "status": status}
