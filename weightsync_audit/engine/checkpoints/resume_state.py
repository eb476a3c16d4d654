"""Resume fidelity, per rank: what a resume must restore besides the weights, taken at a checkpoint and
exchanged; whether each rank got its own is :mod:`~weightsync_audit.engine.checkpoints.resume_rules`' to say.

At a checkpoint every rank digests what a resume must give it back (:class:`ResumeSources`): its RNG states
(torch CPU, CUDA when in use, numpy, Python ``random``), its data position (a sampler's epoch, seed and
rank; the framework's loop position; a stateful loader's ``state_dict``), the lr schedulers and the grad
scaler. The digests of every rank go into the checkpoint's sidecar under ``resume`` (:func:`resume_at_save`).
At resume each rank digests the same things again and every rank compares all of them alike
(:func:`resume_at_load`).

Both are collective (every rank of the audit calls them at the same point, after the checkpoint's own
audit) and give the same ``resume`` entry on every rank: ``{"status", "checked", "findings"}`` with
``status`` ``recorded`` (at a save: the digests are in the sidecar), ``exact`` (every rank resumed to its
own state), ``differs`` (``findings`` say what did not come back and where) or ``unchecked`` (``why``).

>>> import os, tempfile, torch
>>> from weightsync_audit import Auditor
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
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import xxhash

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.checkpoints.load import load_checkpoint
from weightsync_audit.engine.checkpoints.resume_rules import (
    checked_components,
    compare,
    is_error,
    just_seeded,
    saved_differences,
)
from weightsync_audit.engine.checkpoints.sidecar import SidecarError, read_sidecar, sidecar_path, write_sidecar
from weightsync_audit.engine.hashing.reader import host_view, readable
from weightsync_audit.errors import CheckpointError, warn_user
from weightsync_audit.reporting.record import AuditResult

__all__ = [
    "ResumeSources",
    "attach_resume",
    "capture",
    "digest_state",
    "finish_resume",
    "resume_at_load",
    "resume_at_save",
    "rng_file_state",
    "rng_now",
]


def _feed(h: Any, obj: Any) -> None:
    """Feed ``obj``'s exact content into the hash: tensors and arrays by their bytes, containers in order."""
    if isinstance(obj, torch.Tensor):
        t = readable(obj, "a resume-state tensor")  # its local data; what has no bytes refused
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(host_view(t))
    elif type(obj).__module__ == "numpy" and hasattr(obj, "tobytes"):
        h.update(f"A{getattr(obj, 'dtype', '')}{getattr(obj, 'shape', '')}".encode())
        h.update(obj.tobytes())
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for k in sorted(obj, key=str):
            h.update(repr(k).encode())
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for x in obj:
            _feed(h, x)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def digest_state(obj: Any) -> str:
    """16 hex digits of xxh3-64 over ``obj``'s content (tensors, numpy arrays, containers, plain values).

    >>> digest_state({"a": torch.zeros(2)}) == digest_state({"a": torch.zeros(2)})
    True
    """
    h = xxhash.xxh3_64()
    _feed(h, obj)
    return f"{h.intdigest():016x}"


def _entry(obj: Any, value: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"digest": digest_state(obj)}
    if value is not None:
        out["value"] = value
    return out


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it (a short repr otherwise)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)[:200]


def rng_file_state(path: str) -> dict[str, Any]:
    """The RNG states a resume will load from ``path`` (the Hugging Face Trainer's ``rng_state_{rank}.pth``:
    ``python``, ``numpy``, ``cpu``, ``cuda``), as the components they restore. Read by the one loader
    (``weights_only=True`` with numpy's RNG types allowed): a file that needs code is refused
    (:class:`~weightsync_audit.errors.UnsafeCheckpointError` naming it), never loaded unsafely."""
    state = load_checkpoint(path)
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path}: not an RNG state file (a dict of generator states), but {type(state).__name__}")
    out: dict[str, Any] = {}
    for key, comp in (("cpu", "rng.torch"), ("cuda", "rng.cuda"), ("numpy", "rng.numpy"), ("python", "rng.python")):
        if key in state:
            value = state[key]
            if key == "cuda" and isinstance(value, torch.Tensor):  # one device's state (a run of one process)
                value = [value]
            out[comp] = _entry(value)
    return out


def _rng_entry(component: str, state: Any) -> dict[str, Any]:
    """A live generator's entry; ``seeded`` when it is freshly seeded (no draw since; never written to a
    sidecar) and, for torch's, the seed its stream started from as the value: together they tell a re-seed at
    start from a state restored from another rank (:mod:`.resume_rules`)."""
    out = _entry(state, {"seed": int(torch.initial_seed())} if component == "rng.torch" else None)
    if just_seeded(component, state):
        out["seeded"] = True
    return out


def rng_now() -> dict[str, dict[str, Any]]:
    """This process's RNG states now: torch CPU; CUDA when initialised; numpy when imported; ``random``."""
    out = {"rng.torch": _rng_entry("rng.torch", torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["rng.cuda"] = _entry(torch.cuda.get_rng_state_all())
    if "numpy" in sys.modules:
        out["rng.numpy"] = _rng_entry("rng.numpy", sys.modules["numpy"].random.get_state())
    out["rng.python"] = _rng_entry("rng.python", random.getstate())
    return out


def _sampler_entry(sampler: Any) -> dict[str, Any]:
    """A sampler's entry: a ``DistributedSampler``'s fields, a ``state_dict()``, or the state of the generator it
    draws its order from; a sampler with none of these has no state of its own to check (``why``)."""
    if hasattr(sampler, "num_replicas") and hasattr(sampler, "rank"):
        value = {k: getattr(sampler, k, None) for k in ("epoch", "seed", "rank", "num_replicas")}
        return _entry(value, _plain(value))
    if callable(getattr(sampler, "state_dict", None)):
        return _entry(sampler.state_dict())
    generator = getattr(sampler, "generator", None)
    if isinstance(generator, torch.Generator):
        return _entry(generator.get_state())
    name = type(sampler).__name__
    return {
        "why": f"{name} has no state_dict() and no generator of its own (its order comes from the torch RNG, "
        "checked as such; its place in an epoch is not kept)"
    }


@dataclass(kw_only=True, slots=True)
class ResumeSources:
    """What a resume must restore on this rank, digested by :meth:`capture`.

    >>> sources = ResumeSources(data_position={"step": 4})
    >>> captured = sources.capture()
    >>> captured["data.position"]["value"], "rng.torch" in captured
    ({'step': 4}, True)
    """

    rng: bool = True
    """Digest this process's RNG states (torch CPU; CUDA when initialised; numpy when imported; ``random``)."""
    rng_file: str | None = None
    """Read the RNG states from this file instead of the live generators (what a resume *will* load:
    the Hugging Face Trainer restores ``rng_state_{rank}.pth`` after ``on_train_begin``)."""
    lr_schedulers: Sequence[Any] = ()
    """The lr schedulers (anything with ``state_dict()``; ``last_epoch`` is shown as the step)."""
    grad_scaler: Any = None
    """A ``torch.amp.GradScaler`` (or anything with ``state_dict()``); ``None``: none."""
    sampler: Any = None
    """A ``DistributedSampler`` (its ``epoch``, ``seed``, ``rank``, ``num_replicas``) or a sampler with
    ``state_dict()``."""
    data_position: Any = None
    """Where this rank is in its data: a step, a dict (``{"step": 4, "epoch": 1}``), a stateful loader's
    ``state_dict()``. A ``step`` in it names where a reset restarted."""
    rng_state: Mapping[str, Any] | None = None
    """The RNG components as :func:`rng_now` took them earlier, at the framework's restore point (Lightning
    draws from the generator between ``on_load_checkpoint`` and the first hook that can compare)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Further components by name (``"data.position"``-like keys), digested as they are."""
    causes: Mapping[str, str] = field(default_factory=dict)
    """Component -> why it may not be what was saved (known to the framework adapter, e.g. Lightning restarting
    a plain DataLoader mid-epoch), said with a finding about that component."""

    def capture(self) -> dict[str, dict[str, Any]]:
        """Component -> ``{"digest", "value"?}`` on this rank now; a component that cannot be digested is
        ``{"why"}`` (named in a note) and the others are still checked."""
        out: dict[str, dict[str, Any]] = {}
        if self.rng_file is not None:
            out.update(rng_file_state(self.rng_file))
        elif self.rng_state is not None:
            out.update(self.rng_state)
        elif self.rng:
            out.update(rng_now())
        for i, sched in enumerate(self.lr_schedulers):
            out["lr_scheduler" if i == 0 else f"lr_scheduler.{i}"] = _guarded(_scheduler_entry, sched)
        if self.grad_scaler is not None:
            out["grad_scaler"] = _guarded(lambda s: _entry(s.state_dict()), self.grad_scaler)
        if self.sampler is not None:
            out["data.sampler"] = _guarded(_sampler_entry, self.sampler)
        if self.data_position is not None:
            pos = self.data_position
            out["data.position"] = _entry(
                pos, _plain(pos) if isinstance(pos, (int, dict)) and len(str(pos)) < 200 else None
            )
        for name, obj in self.extra.items():
            out[name] = _entry(obj)
        for name, cause in self.causes.items():
            if name in out and "digest" in out[name]:
                out[name]["cause"] = str(cause)
        return out


def _scheduler_entry(sched: Any) -> dict[str, Any]:
    step = getattr(sched, "last_epoch", None)
    return _entry(sched.state_dict(), {"step": step} if isinstance(step, int) else None)


def _guarded(take: Callable[[Any], dict[str, Any]], obj: Any) -> dict[str, Any]:
    """``take(obj)``, or ``{"why"}`` naming the error: one component that cannot be read is named, not the end
    of every other component's check."""
    try:
        return take(obj)
    except Exception as exc:  # noqa: BLE001
        return {"why": f"it could not be read ({type(exc).__name__}: {exc})"}


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
