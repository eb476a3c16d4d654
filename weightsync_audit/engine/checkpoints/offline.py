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

And :func:`diff_sidecars`: two checkpoints compared by their sidecars, loading neither: the digests of their
tensors, trusted only while each file is still the one its sidecar identifies (``files``); a file changed
since makes the comparison fail naming it; a sidecar that cannot tell (without ``files``), a malformed one,
or a DCP folder's is no basis for a comparison (``why_not``): the files themselves are compared.

>>> verify_resume(Path("."), {})["status"]
'unchecked'
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from weightsync_audit.engine.checkpoints.folder import Unit, dcp_shards, file_changes, folder_units, inside
from weightsync_audit.engine.checkpoints.load import (
    UnreadableCheckpointError,
    open_unit,
    read_json,
    regular_file,
    stream_flat,
)
from weightsync_audit.engine.checkpoints.resume_rules import compare, is_error, saved_differences
from weightsync_audit.engine.checkpoints.resume_state import rng_file_state
from weightsync_audit.engine.checkpoints.sidecar import (
    SidecarError,
    match_prefix,
    read_sidecar,
    same_digest,
    sidecar_path,
    tensor_digests,
)
from weightsync_audit.errors import CheckpointError, UnsafeCheckpointError

__all__ = ["SidecarDiff", "diff_sidecars", "verify_checkpoint", "verify_resume"]


def _rng_files(folder: Path, saved: Mapping[str, Any]) -> list[dict[str, Any]]:
    names = {r: f"rng_state_{r}.pth" if len(saved) > 1 else "rng_state.pth" for r in saved}
    present = {r: inside(folder, n) for r, n in names.items() if (folder / n).is_file()}
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
    state = inside(folder, "trainer_state.json")
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


def _match(digests: Mapping[str, Any], saved: Mapping[str, Any], found: dict[str, Any]) -> None:
    """Add to ``found`` (sidecar name -> digest entry) the names of ``saved`` not found yet that ``digests``
    (one file's tensors) holds, under the prefix they sit at there (``module.`` in a DeepSpeed model file,
    ``model.`` in ``torch.save({"model": model.state_dict()})``)."""
    wanted = {n: e for n, e in saved.items() if n not in found}
    prefix = match_prefix(digests, wanted, by_digest=True)
    found.update({n: digests[prefix + n] for n in wanted if prefix + n in digests})


def _units(p: Path) -> list[Unit]:
    """The units of tensors ``verify`` reads (a file named on the command line whatever its name)."""
    if p.is_file():
        return [u._replace(kind="tensors") for u in folder_units(p)]
    return [u for u in folder_units(p) if u.kind == "tensors"]


def _digests(p: Path, sidecar: Mapping[str, Any], out: dict[str, Any], gone: set[str] | None, progress: Any) -> Any:
    """Name (as in the sidecar) -> digest entry of every saved tensor found in the checkpoint's units of
    tensors, read one tensor at a time, in name order until every one is found. A file known changed
    (``gone``) that cannot be read whole (truncated) is reported changed with its sizes, never as unreadable. A file that would need
    code to load is refused (:class:`UnsafeCheckpointError`), unless it is still as saved (the engine's own,
    such as DeepSpeed's optimizer files), then it is listed in ``out["skipped"]``; with a sidecar that
    identifies no file (``gone`` is ``None``), listed likewise, as before."""
    saved, recorded = sidecar["tensors"], sidecar.get("files")
    found: dict[str, dict[str, Any]] = {}
    for u in _units(p):
        names = [f.relative_to(p).as_posix() if p.is_dir() else f.name for f in u.files]
        if len(found) == len(saved):
            break
        digests: dict[str, Any] = {}
        try:
            for n, v in stream_flat(u.files, progress):
                digests.update(tensor_digests({n: v}))
        except UnreadableCheckpointError:
            if not (gone and (p.is_file() or gone & set(names))):
                raise
            out["unread"].append(u.name)  # known changed (sizes said): its tensors are not named missing
            continue
        except UnsafeCheckpointError:
            if p.is_file() or (recorded is not None and not set(names) <= set(recorded) - (gone or set())):
                raise
            out["skipped"].append(u.name)
            continue
        _match(digests, saved, found)
    return found


def _check_files(p: Path, sidecar: Mapping[str, Any], out: dict[str, Any]) -> set[str] | None:
    """The files of ``p`` against the sidecar's ``files`` (DCP shards against ``shards``, naming their
    rank) into ``out``; the names of the files changed or gone (``None``: the sidecar identifies none)."""
    shards = sidecar.get("shards") or {}
    if shards:
        now = dcp_shards(p)
        for f, s in sorted(shards.items()):
            if f not in now:
                out["missing"].append(f"{f} (rank {s['rank']})")
            elif now[f]["digest"] != s["digest"]:
                size = now[f]["bytes"]
                how = f": {s['bytes']} bytes when saved, {size} now" if size != s["bytes"] else ""
                out["changed"].append(f"{f} (rank {s['rank']}{how})")
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
    return {c.split(" (", 1)[0] for c in now.changed} | set(now.missing)


def verify_checkpoint(path: str | Path, progress: Any = None) -> dict[str, Any]:
    """The outcome of checking ``path`` against its sidecar: ``status`` (``verified``, ``unverified``,
    ``diverged``, ``changed``), ``changed`` (names, or shard files with their ``rank``), ``missing``,
    ``changed_files``, ``missing_files`` and ``added_files`` (the files no longer as saved: ``files``), ``files``
    (``identified``, or ``unidentified`` for a sidecar of an earlier version that names none).

    Raises :class:`CheckpointError` when the checkpoint or its sidecar cannot be read, it is no checkpoint
    (a text, a report), a path in it leads outside its folder, or a file of it would need code to load
    (:class:`UnsafeCheckpointError`, never loaded). ``progress``: called with the bytes of each tensor read.
    """
    p = Path(path)
    if not p.is_dir():
        regular_file(p)  # no such file, or a FIFO or device: refused (one never waited on)
    sidecar = read_sidecar(p)
    out: dict[str, Any] = {"path": str(p), "sidecar": str(sidecar_path(p)), "changed": [], "missing": []}
    out.update(changed_files=[], missing_files=[], added_files=[], skipped=[], unread=[])
    if sidecar is None:
        units = _units(p)
        if not units:
            raise CheckpointError(f"{p}: the folder holds no checkpoint files, nor a sidecar")
        open_unit(units[0].files)  # no checkpoint at all (a text, a report): refused as diff refuses it
        return {**out, "status": "unverified", "why": f"no sidecar ({sidecar_path(p).name})"}
    out.update(step=sidecar.get("step"), world_size=sidecar.get("world_size"), saved=sidecar["verdict"])
    out["not_compared"] = list(sidecar.get("partitioned") or [])  # saved as each rank's partition only
    gone = _check_files(p, sidecar, out)
    if "shards" not in sidecar:
        saved = sidecar["tensors"]
        now = _digests(p, sidecar, out, gone, progress)
        tied = sidecar.get("tied") or {}
        partitioned = bool(sidecar.get("partitioned"))
        for n, e in sorted(saved.items()):
            held = now.get(n)
            if held is None and tied.get(n) in now and saved.get(tied[n], {}).get("digest") == e["digest"]:
                held = now[tied[n]]  # saved once for both names (tied weights), as the sidecar recorded
            if held is None:
                if not out["unread"]:  # else in a file changed and unreadable, reported as changed
                    out["missing"].append(n)
            elif partitioned and not math.prod(held["shape"]) and math.prod(e["shape"]):
                out["not_compared"].append(n)  # ZeRO-3 saves every parameter as a placeholder in the model file
            elif not same_digest(held, e):
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


@dataclass(slots=True)
class SidecarDiff:
    """The outcome of comparing two checkpoints by their sidecars."""

    rows: list[tuple[str, str]] = field(default_factory=list)
    """``(name, missing|extra|values)`` for every tensor whose saved digest differs."""
    count: int = 0
    """How many tensors A's sidecar records."""
    stale: list[str] = field(default_factory=list)
    """``A: m.pt (1200 bytes when saved, 1300 now)``: files no longer as their sidecar identifies them."""
    why_not: str | None = None
    """Why the sidecars are no basis for a comparison (then the files are compared); ``None`` when they are."""

    @property
    def identical(self) -> bool:
        """Every tensor has the same saved digest and every file is still the one its sidecar identifies."""
        return self.why_not is None and not self.rows and not self.stale


def diff_sidecars(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> SidecarDiff | None:
    """Compare A and B by their sidecars; ``None`` when either has none. Each file is checked against its
    sidecar's ``files`` first (its bytes are read, never interpreted)."""
    sides = {}
    for label, path in (("A", a), ("B", b)):
        if not os.path.exists(path):
            return None  # the files are compared: "no such file"
        try:
            sidecar = read_sidecar(path)
        except SidecarError as exc:
            return SidecarDiff(why_not=f"{label}'s sidecar is unusable ({exc})")
        if sidecar is None:
            return None
        if "shards" in sidecar:
            return SidecarDiff(why_not=f"{label} is a torch.distributed.checkpoint folder (its sidecar records shards)")
        if "files" not in sidecar:
            return SidecarDiff(
                why_not=f"{label}'s sidecar does not identify its files (written by an earlier version): unidentified"
            )
        sides[label] = (path, sidecar)
    out = SidecarDiff()
    for label, (path, sidecar) in sides.items():
        now = file_changes(path, sidecar["files"])
        out.stale += [f"{label}: {c}" for c in now.changed] + [f"{label}: {m} is gone" for m in now.missing]
        out.stale += [f"{label}: {m} was added" for m in now.added]
    ta, tb = sides["A"][1]["tensors"], sides["B"][1]["tensors"]
    out.rows = [(n, "missing") for n in sorted(set(ta) - set(tb))] + [(n, "extra") for n in sorted(set(tb) - set(ta))]
    out.rows += [(n, "values") for n in sorted(set(ta) & set(tb)) if ta[n] != tb[n]]
    out.count = len(ta)
    return out
