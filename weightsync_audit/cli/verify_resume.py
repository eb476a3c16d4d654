"""The per-rank resume checks ``weightsync-audit verify`` makes offline, from the sidecar's ``resume``.

On one machine no rank is running, so what can be checked is what the checkpoint will give each rank:

- what is meant to be equal on every replica (lr schedulers, the grad scaler) was equal when saved;
- a Hugging Face folder's ``rng_state_{rank}.pth`` files still hold each rank's *own* saved RNG state
  (``rank 1's rng_state_1.pth holds rank 0's RNG state``: the file a resume of rank 1 would load);
- its ``trainer_state.json`` resumes at the step the sidecar saved, and its ``scheduler.pt`` is there.

>>> verify_resume(Path("."), {})["status"]
'unchecked'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from weightsync_audit.engine.checkpoints.resume_state import compare, is_error, rng_file_state, saved_differences

__all__ = ["verify_resume"]


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
