"""The collective side of resume fidelity: every rank's digests into the sidecar at a save, every rank
checked against its own at a resume (:mod:`~weightsync_audit.engine.checkpoints.resume_state` decides).

Both are collective (every rank of the audit calls them at the same point, after the checkpoint's own
audit) and give the same ``resume`` entry on every rank: ``{"status", "checked", "findings"}`` with
``status`` ``recorded`` (at a save: the digests are in the sidecar), ``exact`` (every rank resumed to its
own state), ``differs`` (``findings`` say what did not come back and where) or ``unchecked`` (``why``).

>>> import os, tempfile, torch
>>> from weightsync_audit import Auditor
>>> from weightsync_audit.engine.checkpoints.resume_state import ResumeSources
>>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
>>> auditor = Auditor(torch.nn.Linear(2, 2))
>>> torch.save({}, path)
>>> _ = auditor.checkpoint_saved(path, 4)
>>> sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), lambda s: 1.0)
>>> sched.last_epoch = 4  # as after 4 steps
>>> resume_at_save(auditor.comm, path, ResumeSources(lr_schedulers=[sched]))["status"]
'recorded'
>>> sched.last_epoch = 0
>>> resume_at_load(auditor.comm, path, ResumeSources(lr_schedulers=[sched]))["findings"][0]["detail"]
'the lr scheduler restarted at step 0 (saved at step 4) on rank 0'
"""

from __future__ import annotations

import json
from typing import Any

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.attribution.blame import blame_hint, checkpoint_blame
from weightsync_audit.engine.checkpoints.resume_state import (
    ResumeSources,
    checked_components,
    compare,
    is_error,
    saved_differences,
)
from weightsync_audit.engine.checkpoints.sidecar import SidecarError, read_sidecar, sidecar_path, write_sidecar
from weightsync_audit.errors import warn_user
from weightsync_audit.reporting.record import AuditResult, Mismatch
from weightsync_audit.text import without_tie

__all__ = ["attach_resume", "capture", "checkpoint_evidence", "finish_resume", "resume_at_load", "resume_at_save"]


def _same_tensor(saved: Mismatch, audited: Mismatch) -> bool:
    """``saved`` (named as in the checkpoint: ``state_dict.net.0.bias``) and ``audited`` are one tensor."""
    return audited.kind == saved.kind and (saved.name == audited.name or saved.name.endswith("." + audited.name))


def checkpoint_evidence(result: AuditResult, changed: list[Mismatch], saved: str) -> None:
    """The checkpoint is evidence: a tensor some rank holds other than ``saved`` (the file and its step) is one
    mismatch, the audit's when the ranks differ too (the comparison a property of it): the ranks holding what
    was saved are its reference, the others the wrong side. The blame names them (evidence ``checkpoint``)
    unless the records named ranks already; the hint says so, and where no rank holds the saved bytes."""
    for c in changed:
        m = next((m for m in result.mismatches if _same_tensor(c, m)), None)
        if m is None:
            result.mismatches.append(c)
            continue
        if c.reference_ranks:  # the saved bytes decide which side is right (a tie is one no longer)
            m.ranks, m.reference_ranks = list(c.ranks), list(c.reference_ranks)
            m.detail = without_tie(m.detail)
        m.detail = "; ".join(x for x in (m.detail, c.detail or "") if x)
    if not changed:
        return
    held = result.blame or {}
    if held.get("ranks") and held.get("evidence") not in ("vote", "undecided"):
        return  # named by their own records: the records decide
    blame = checkpoint_blame(changed, saved, result.step)
    result.blame = blame.as_dict()
    said = [h for h in result.hints if not h.startswith(("attribution undecided", "by vote:"))]  # superseded
    result.hints = [blame_hint(blame, result.hosts), *said]


def capture(sources: ResumeSources) -> dict[str, Any]:
    """This rank's components now (before the audit runs, so that nothing moves them in between); an
    error is kept and said on every rank after the exchange, never raised on one rank alone."""
    try:
        return sources.capture()
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


def _gather(comm: Comm, mine: dict[str, Any], what: str) -> dict[str, dict[str, Any]]:
    """Every rank's captured components, by global rank (as a string, the sidecar's key), on every rank."""
    parts = [json.loads(p) for p in comm.exchange_bytes(json.dumps(mine).encode(), what)]
    return {str(g): p for g, p in zip(comm.global_ranks, parts)}


def _errors(gathered: dict[str, dict[str, Any]]) -> str | None:
    bad = [f"rank {r}: {p['error']}" for r, p in gathered.items() if "error" in p]
    return "; ".join(bad) or None


def resume_at_save(comm: Comm, path: Any, sources: ResumeSources | dict[str, Any]) -> dict[str, Any]:
    """Digest what a resume must restore on every rank and add it to the sidecar of ``path`` (written by
    the group's first rank, after the checkpoint's audit wrote the sidecar). Collective."""
    mine = sources if isinstance(sources, dict) else capture(sources)
    gathered = _gather(comm, mine, "the resume state")
    why = _errors(gathered)
    if why is not None:
        return {"status": "unchecked", "checked": [], "findings": [], "why": why}
    if comm.rank == 0:
        target = sidecar_path(path)
        try:
            sidecar = read_sidecar(path)
            if sidecar is None:
                raise SidecarError(f"{target}: no sidecar to add it to")
            sidecar["resume"] = {"ranks": _kept(gathered)}
            write_sidecar(path, sidecar)
        except (OSError, SidecarError) as exc:  # the run goes on; the resume will say it is unchecked
            warn_user(f"weightsync: could not add the resume state to {target}: {exc}")
    findings = saved_differences(gathered)
    status = "differs" if any(is_error(f) for f in findings) else "recorded"
    return {"status": status, "checked": checked_components(gathered), "findings": findings}


def _kept(gathered: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What the sidecar keeps of every rank's entries: ``digest`` and ``value`` of each component digested (a
    component no rank could digest is said in a note, a generator's ``seeded`` and a ``cause`` only matter
    at the resume)."""
    return {
        r: {c: {k: v for k, v in e.items() if k in ("digest", "value")} for c, e in p.items() if "digest" in e}
        for r, p in gathered.items()
    }


def _read_saved(path: Any) -> Any:
    target = sidecar_path(path)
    try:
        sidecar = read_sidecar(path)  # validated: a malformed resume entry is named here, on every rank alike
    except SidecarError as exc:
        return {"why": str(exc)}
    if sidecar is None:
        return {"why": f"{target.name} is missing"}
    resume = sidecar.get("resume")
    if not isinstance(resume, dict) or not isinstance(resume.get("ranks"), dict):
        return {"why": f"{target.name} holds no resume state (saved without it)"}
    return resume["ranks"]


def resume_at_load(comm: Comm, path: Any, sources: ResumeSources | dict[str, Any]) -> dict[str, Any]:
    """Compare what every rank holds now (``sources``, or what :func:`capture` took of them) with what it
    saved (the sidecar's ``resume``). Collective."""
    mine_now = sources if isinstance(sources, dict) else capture(sources)
    mine = json.dumps(_read_saved(path)).encode() if comm.rank == 0 else None
    saved = json.loads(comm.share_bytes(0, mine, "the saved resume state"))
    now = _gather(comm, mine_now, "the resumed state")
    why = saved.get("why") if isinstance(saved.get("why"), str) else _errors(now)
    try:  # every rank judges the same gathered data: a malformed sidecar is unchecked on all of them alike
        if why is None and sorted(saved, key=int) != sorted(now, key=int):
            why = f"saved on ranks {sorted(map(int, saved))}, resumed on ranks {sorted(map(int, now))}"
        if why is None:
            findings = compare(saved, now)
            checked = checked_components(saved, now)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        why = f"the sidecar's resume state is malformed ({type(exc).__name__}: {exc})"
    if why is not None:
        return {"status": "unchecked", "checked": [], "findings": [], "why": why}
    status = "differs" if any(is_error(f) for f in findings) else "exact"
    return {"status": status, "checked": checked, "findings": findings}


def attach_resume(result: AuditResult, entry: dict[str, Any], is_main: bool) -> None:
    """Put ``entry`` in the record (``checkpoint.resume``) and its findings in the notes; warn on the main
    process, one line each, so that a restarted job says at once what did not come back."""
    if result.checkpoint is None:
        result.checkpoint = {}
    result.checkpoint["resume"] = entry
    lines = [f"resume: {f['detail']}" + ("" if is_error(f) else " (a note)") for f in entry["findings"]]
    result.notes.extend(lines)
    if is_main and lines:
        where = result.checkpoint.get("path", "the checkpoint")
        warn_user(f"weightsync: {where}: " + "; ".join(lines))


def finish_resume(result: AuditResult, comm: Comm, event: str, path: Any, mine: Any, is_main: bool) -> None:
    """After the checkpoint's audit: the resume state taken before it (``mine``, :func:`capture`) into the
    sidecar (``event == "saved"``) or compared with it; nothing when ``mine`` is ``None``. Collective."""
    if mine is not None:
        check = resume_at_save if event == "saved" else resume_at_load
        attach_resume(result, check(comm, path, mine), is_main)
