"""Resume fidelity, per rank: what a resume must restore besides the weights, and whether each rank got its own.

At a checkpoint every rank digests what a resume must give it back (:class:`ResumeSources`): its RNG states
(torch CPU, CUDA when in use, numpy, Python ``random``), its data position (a sampler's epoch, seed and
rank; the framework's loop position; a stateful loader's ``state_dict``), the lr schedulers and the grad
scaler. The digests of every rank go into the checkpoint's sidecar under ``resume``. At resume each rank
digests the same things again and every rank compares all of them alike (:func:`compare`):

- **every rank must hold its own saved state** (``exact``), whatever the other ranks hold;
- a rank that holds what *another* rank saved: ``rank 1 resumed with rank 0's torch RNG state``;
- ranks that saved different states and all resumed to one: ``every rank resumed at the same data
  position although they saved different ones``;
- a state no rank saved (re-created, not restored): ``the lr scheduler restarted at step 0 (saved at
  step 4) on every rank``; an RNG state fresh on *every* rank is a note (``severity: note``: the run
  re-seeds at start, as Lightning does), whether the ranks now hold one state alike or one rank's seed
  state, one fresh on some ranks only is a finding (:mod:`.resume_rules` says what *fresh* is);
- states are compared by value where their entries carry it whole (``1.0`` and ``1`` are one epoch); a
  component a rank cannot digest is named in a note and the others are checked;
- what is meant to be equal on every replica (``scope == "equal"``: lr schedulers, the grad scaler) is
  also compared across ranks at the save: ``the lr scheduler differed across ranks when saved``.

What is meant to differ (per-rank RNG streams, data shards) may also be equal (one seed on every rank):
the rule is only that each rank gets back what *it* saved, so a swap is visible exactly when the ranks
saved different states.

>>> saved = {"0": {"rng.torch": {"digest": "a"}}, "1": {"rng.torch": {"digest": "b"}}}
>>> now = {"0": {"rng.torch": {"digest": "a"}}, "1": {"rng.torch": {"digest": "a"}}}
>>> [f["detail"] for f in compare(saved, now)]
["rank 1 resumed with rank 0's torch RNG state"]
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
import xxhash

from weightsync_audit.engine.checkpoints.load import load_checkpoint
from weightsync_audit.engine.checkpoints.resume_rules import (
    comparison_keys,
    just_seeded,
    reseeded_everywhere,
    unchecked_notes,
    with_cause,
)
from weightsync_audit.engine.hashing.reader import host_view, readable
from weightsync_audit.errors import CheckpointError

__all__ = [
    "COMPONENTS",
    "ResumeSources",
    "checked_components",
    "compare",
    "digest_state",
    "is_error",
    "rng_file_state",
    "rng_now",
    "saved_differences",
]

Scope = Literal["own", "equal"]

COMPONENTS: dict[str, tuple[str, Scope]] = {
    "rng.torch": ("torch RNG state", "own"),
    "rng.cuda": ("CUDA RNG state", "own"),
    "rng.numpy": ("numpy RNG state", "own"),
    "rng.python": ("Python random state", "own"),
    "data.position": ("data position", "own"),
    "data.sampler": ("sampler (epoch, seed, rank)", "own"),
    "lr_scheduler": ("lr scheduler", "equal"),
    "grad_scaler": ("grad scaler", "equal"),
}
"""Component -> (its name in a sentence, ``own``: each rank its own, may differ across ranks; ``equal``:
the same on every replica). ``lr_scheduler.1`` (a second scheduler) reads as ``lr_scheduler``."""


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


def _label(comp: str) -> tuple[str, Scope]:
    base = comp.split(".")[0] if comp.startswith(("lr_scheduler", "grad_scaler")) else comp
    label, scope = COMPONENTS.get(base, (comp, "own"))
    suffix = comp[len(base) :].lstrip(".")
    return (f"{label} {suffix}" if suffix else label), scope


def _ranks_text(ranks: Sequence[int], world: int) -> str:
    if len(ranks) == world and world > 1:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _moved(saved: Mapping[str, Any], now: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """The first of ``step``, ``epoch``, ``batch`` whose shown value moved: ``(key, saved, now)``."""
    was, got = saved.get("value"), now.get("value")
    if isinstance(was, int) and isinstance(got, int) and not isinstance(was, bool):
        was, got = {"step": was}, {"step": got}
    if not (isinstance(was, dict) and isinstance(got, dict)):
        return None
    for key in ("step", "epoch", "batch"):
        if key in was and key in got and was[key] != got[key]:
            return key, was[key], got[key]
    return None


def _merge_rng(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The RNG generators that went wrong alike (same kind, ranks and source) in one line: ``rank 1 resumed
    with rank 0's RNG state (torch, numpy, Python random)``."""
    out: list[dict[str, Any]] = []
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for f in findings:
        if f["component"].startswith("rng.") and f["kind"] != "unequal":
            key = (f["kind"], tuple(f["ranks"]), tuple(f["from_ranks"]), f.get("severity"))
            if key not in groups:
                groups[key] = []
                out.append({"merge": key})
            groups[key].append(f)
        else:
            out.append(f)
    merged = []
    for f in out:
        if "merge" not in f:
            merged.append(f)
            continue
        parts = groups[f["merge"]]
        if len(parts) == 1:
            merged.append(parts[0])
            continue
        names = ", ".join(_label(p["component"])[0].removesuffix(" RNG state").removesuffix(" state") for p in parts)
        first = parts[0]
        label = _label(first["component"])[0]
        detail = first["detail"].replace(label, f"RNG state ({names})")
        merged.append({**first, "component": "rng", "components": [p["component"] for p in parts], "detail": detail})
    return merged


def checked_components(*gathered: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The components that every rank of every one of ``gathered`` (rank -> component -> entry) digested."""
    sets = [{c for c, e in g[r].items() if isinstance(e, Mapping) and "digest" in e} for g in gathered for r in g]
    return sorted(set.intersection(*sets)) if sets else []


def saved_differences(saved: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Findings at a save: a component meant to be equal on every replica that differed across ranks (and a
    note naming a component some rank could not digest)."""
    ranks = sorted(saved, key=int)
    out = []
    for comp in checked_components(saved):
        label, scope = _label(comp)
        digests = {r: saved[r][comp]["digest"] for r in ranks}
        if scope != "equal" or len(set(digests.values())) == 1:
            continue
        first = digests[ranks[0]]
        odd = [int(r) for r in ranks if digests[r] != first]
        out.append({
            "component": comp, "kind": "unequal", "ranks": odd, "from_ranks": [],
            "detail": f"the {label} differed across ranks when saved ({_ranks_text(odd, len(ranks))} held another "
            f"than rank {ranks[0]}); it is meant to be equal on every replica",
        })  # fmt: skip
    return out + unchecked_notes(saved, lambda c: _label(c)[0])


def _reseeded(label: str, s: Mapping[str, str], n: Mapping[str, str], bad: list[str], world: int) -> str:
    """The note's text for a generator re-seeded on every rank (:func:`reseeded_everywhere`)."""
    taken = set(s.values())
    if len(bad) == world and not any(n[r] in taken for r in bad) and not (len(taken) > 1 and len(set(n.values())) == 1):
        return f"the {label} was not restored on {_ranks_text([int(r) for r in bad], world)} (neither what it saved " \
            "nor another rank's)"  # fmt: skip
    where = _ranks_text([int(r) for r in bad], world)
    verb = "hold" if where.startswith("ranks ") else "holds"
    return f"every rank re-seeded the {label} instead of restoring it ({where} now {verb} another state than saved)"


def compare(saved: Mapping[str, Mapping[str, Any]], now: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Findings at a resume: each rank against its own saved state (rank -> component -> entry, both), by value
    where the entries carry their whole state as one, else by digest (:mod:`.resume_rules`).

    Deterministic in its inputs: every rank that compares the same gathered data finds the same."""
    ranks = sorted(saved, key=int)
    if not ranks or sorted(now, key=int) != ranks:
        return []
    world = len(ranks)
    out: list[dict[str, Any]] = []
    order = list(COMPONENTS)
    for comp in sorted(checked_components(saved, now), key=lambda c: (order.index(c) if c in order else len(order), c)):
        label, _ = _label(comp)
        s, n = comparison_keys(comp, saved, now, ranks)
        bad = [r for r in ranks if n[r] != s[r]]
        if not bad:
            continue
        # Fresh on every rank (re-seeded at start, not restored) is a policy, said as a note, whatever shape it
        # takes: one state alike on every rank, or the seed state one rank saved before it drew.
        if reseeded_everywhere(comp, saved, now, (s, n), ranks):
            out.append({
                "component": comp, "kind": "not_restored", "ranks": [int(r) for r in bad], "from_ranks": [],
                "detail": _reseeded(label, s, n, bad, world), "severity": "note",
            })  # fmt: skip
            continue
        if len(set(s.values())) > 1 and len(bad) > 1 and len(set(n.values())) == 1:
            src = [int(r) for r in ranks if s[r] == n[ranks[0]]]
            whose = f" ({_ranks_text(src, world)}'s)" if src else ""
            out.append({
                "component": comp, "kind": "collapsed", "ranks": [int(r) for r in bad], "from_ranks": src,
                "detail": with_cause(
                    f"every rank resumed at the same {label}{whose} although they saved different ones", comp, now, bad
                ),
            })  # fmt: skip
            continue
        lost = []
        for r in bad:
            others = [q for q in ranks if q != r and s[q] == n[r] and s[q] != s[r]]
            if others:
                out.append({
                    "component": comp, "kind": "from_rank", "ranks": [int(r)], "from_ranks": [int(others[0])],
                    "detail": with_cause(f"rank {r} resumed with rank {others[0]}'s {label}", comp, now, [r]),
                })  # fmt: skip
            else:
                lost.append(r)
        if lost:
            moved = _moved(saved[lost[0]][comp], now[lost[0]][comp])
            where = _ranks_text([int(r) for r in lost], world)
            if moved is not None:
                detail = f"the {label} restarted at {moved[0]} {moved[2]} (saved at {moved[0]} {moved[1]}) on {where}"
            else:
                detail = f"the {label} was not restored on {where} (neither what it saved nor another rank's)"
            out.append({
                "component": comp, "kind": "not_restored", "ranks": [int(r) for r in lost], "from_ranks": [],
                "detail": with_cause(detail, comp, now, lost),
            })  # fmt: skip
    return _merge_rng(out) + unchecked_notes(now, lambda c: _label(c)[0])


def is_error(finding: Mapping[str, Any]) -> bool:
    """A finding that makes a resume ``differs`` (all but a generator re-seeded on every rank: a note)."""
    return finding.get("severity", "error") != "note"
