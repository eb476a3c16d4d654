"""What ``weightsync-audit verify`` checks of a checkpoint on one machine, with no rank running.

:func:`verify_checkpoint`: the sidecar says every replica agreed when it was saved (``verified``) and every
tensor (every shard file, for a ``torch.distributed.checkpoint`` folder) still has the digest it had then;
else it names the tensors or shards (and their ranks) that changed or are missing.

:func:`verify_resume`, from the sidecar's ``resume``: what the checkpoint will give each rank:

- what is meant to be equal on every replica (lr schedulers, the grad scaler) was equal when saved;
- a Hugging Face folder's ``rng_state_{rank}.pth`` files still hold each rank's *own* saved RNG state
  (``rank 1's rng_state_1.pth holds rank 0's RNG state``: the file a resume of rank 1 would load);
- its ``trainer_state.json`` resumes at the step the sidecar saved, and its ``scheduler.pt`` is there.

>>> verify_resume(Path("."), {})["status"]
'unchecked'
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from weightsync_audit.engine.checkpoints.diff import CHECKPOINT_SUFFIXES
from weightsync_audit.engine.checkpoints.load import load_checkpoint
from weightsync_audit.engine.checkpoints.resume_state import compare, is_error, rng_file_state, saved_differences
from weightsync_audit.engine.checkpoints.sidecar import (
    SidecarError,
    dcp_shards,
    read_sidecar,
    sidecar_path,
    tensor_digests,
)
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
        step = json.loads(state.read_text()).get("global_step")
    except (OSError, ValueError):
        return []
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

    Raises :class:`CheckpointError` when the checkpoint or its sidecar cannot be read.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    try:
        sidecar = read_sidecar(p)
    except SidecarError as exc:
        raise CheckpointError(str(exc)) from None
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
        now = _folder_digests(p, sorted(saved), out) if p.is_dir() else tensor_digests(load_checkpoint(p))
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
    out["resume"] = verify_resume(p, sidecar)  # each rank's own RNG, position, schedulers (below)
    return {**out, "status": status}
