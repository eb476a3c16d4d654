"""Resume fidelity compared: whether each rank got back its own saved state (:func:`compare`), and what
differed at a save (:func:`saved_differences`); :mod:`~weightsync_audit.engine.checkpoints.resume_state` takes the
states and exchanges them.

- **every rank must hold its own saved state** (``exact``), whatever the other ranks hold;
- a rank that holds what *another* rank saved: ``rank 1 resumed with rank 0's torch RNG state``;
- ranks that saved different states and all resumed to one: ``every rank resumed at the same data
  position although they saved different ones``;
- a state no rank saved (re-created, not restored): ``the lr scheduler restarted at step 0 (saved at
  step 4) on every rank``;
- what is meant to be equal on every replica (``scope == "equal"``: lr schedulers, the grad scaler) is
  also compared across ranks at the save: ``the lr scheduler differed across ranks when saved``.

What is meant to differ (per-rank RNG streams, data shards) may also be equal (one seed on every rank):
the rule is only that each rank gets back what *it* saved, so a swap is visible exactly when the ranks
saved different states. The rules it compares by:

- **Values, not their Python types.** A component whose shown ``value`` is the whole state it digests (a data
  position, a ``DistributedSampler``'s fields) is compared by that value, numbers by what they are worth:
  the epoch ``1.0`` a Trainer saved and the ``1`` it resumes at are one position (:func:`comparison_keys`).
- **A generator re-seeded on every rank is a note.** An RNG state is *fresh* on a rank when no rank saved it,
  or when it is a freshly seeded one (no draw since the seed: :func:`just_seeded`) that the rank saved itself
  or that starts from the seed its own saved stream started from (known for torch's generator). When every
  rank's is fresh, the run re-seeded at start instead of restoring (a policy, said as a note), whether the
  ranks now hold different states, one state alike, or the seed state one rank saved because it had not
  drawn since (:func:`reseeded_everywhere`). Another rank's saved state, drawn from or from another seed,
  is never fresh: a rank that got it resumed with that rank's state.
- **What cannot be checked is named.** A component a rank could not digest (a sampler with no state of its
  own) is a note naming it, and the others are checked (:func:`unchecked_notes`).

>>> saved = {"0": {"rng.torch": {"digest": "a"}}, "1": {"rng.torch": {"digest": "b"}}}
>>> now = {"0": {"rng.torch": {"digest": "a"}}, "1": {"rng.torch": {"digest": "a"}}}
>>> [f["detail"] for f in compare(saved, now)]
["rank 1 resumed with rank 0's torch RNG state"]
>>> torch.manual_seed(42)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> just_seeded("rng.torch", torch.get_rng_state())
True
>>> _ = torch.rand(1)
>>> just_seeded("rng.torch", torch.get_rng_state())
False
"""

from __future__ import annotations

import json
from typing import Any, Callable, Literal, Mapping, Sequence

import torch

__all__ = [
    "COMPONENTS",
    "WHOLE_VALUE",
    "checked_components",
    "compare",
    "comparison_keys",
    "is_error",
    "just_seeded",
    "reseeded_everywhere",
    "saved_differences",
    "unchecked_notes",
    "with_cause",
]

WHOLE_VALUE = ("data.position", "data.sampler")
"""Components whose ``value``, when they carry one that is not a text, is all that their digest covers."""

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


_MT_FROM_ARRAY = 0x80000000
"""The first word of a Mersenne Twister seeded from an array (Python's ``random.seed``, numpy's array seeds)."""


def _torch_seeded(state: torch.Tensor) -> bool:
    g = torch.Generator()
    try:
        g.set_state(state)
    except (RuntimeError, TypeError):
        return False
    return torch.equal(torch.Generator().manual_seed(g.initial_seed()).get_state(), state)


def _numpy_seeded(state: Any) -> bool:
    try:
        name, keys, pos, has_gauss = state[:4]
        if name != "MT19937" or int(pos) != 624 or has_gauss:
            return False
        first = int(keys[0])
        if first == _MT_FROM_ARRAY:
            return True
        import numpy as np

        return bool(np.array_equal(np.random.RandomState(first).get_state()[1], keys))
    except (TypeError, ValueError, IndexError):
        return False


def _python_seeded(state: Any) -> bool:
    try:
        version, internal, gauss = state
        return version == 3 and gauss is None and internal[-1] == 624 and internal[0] == _MT_FROM_ARRAY
    except (TypeError, ValueError, IndexError):
        return False


_SEEDED: dict[str, Callable[[Any], bool]] = {
    "rng.torch": _torch_seeded,
    "rng.numpy": _numpy_seeded,
    "rng.python": _python_seeded,
}


def just_seeded(component: str, state: Any) -> bool:
    """Whether ``state`` (of the generator ``component``) is a freshly seeded one, with no draw since: a torch
    state equal to a new generator's under its own seed; numpy's and Python's Mersenne Twister at the start
    of its first block (a seeded key). A state after draws reads as fresh only by a 2**-32 coincidence."""
    check = _SEEDED.get(component)
    return bool(check and check(state))


def _canonical(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return repr(value)


def _whole(entry: Mapping[str, Any]) -> bool:
    return "value" in entry and not isinstance(entry["value"], str)


def comparison_keys(
    component: str, saved: Mapping[str, Any], now: Mapping[str, Any], ranks: Sequence[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """What each rank's saved and current ``component`` is compared by: its value (numbers by worth) when every
    entry carries its whole state as a value, else its digest.

    >>> saved = {"0": {"data.position": {"digest": "a", "value": {"epoch": 1.0}}}}
    >>> now = {"0": {"data.position": {"digest": "b", "value": {"epoch": 1}}}}
    >>> s, n = comparison_keys("data.position", saved, now, ["0"])
    >>> s == n
    True
    """
    entries = [saved[r][component] for r in ranks] + [now[r][component] for r in ranks]
    if component in WHOLE_VALUE and all(_whole(e) for e in entries):

        def key(e: Mapping[str, Any]) -> str:
            return "v" + json.dumps(_canonical(e["value"]), sort_keys=True)

    else:

        def key(e: Mapping[str, Any]) -> str:
            return "d" + str(e["digest"])

    return {r: key(saved[r][component]) for r in ranks}, {r: key(now[r][component]) for r in ranks}


def _seed(entry: Mapping[str, Any]) -> Any:
    value = entry.get("value")
    return value.get("seed") if isinstance(value, Mapping) else None


def reseeded_everywhere(
    component: str,
    saved: Mapping[str, Any],
    now: Mapping[str, Any],
    keys: tuple[Mapping[str, str], Mapping[str, str]],
    ranks: Sequence[str],
) -> bool:
    """Whether every rank's generator ``component`` is fresh now (see the module's rules): a re-seed at start.
    ``keys``: what the saved and current entries compare by (:func:`comparison_keys`)."""
    if not component.startswith("rng."):
        return False
    s, n = keys
    taken = set(s.values())

    def fresh(r: str) -> bool:
        if n[r] not in taken:
            return True
        mine, was = now[r][component], saved[r][component]
        return bool(mine.get("seeded")) and (n[r] == s[r] or (_seed(mine) is not None and _seed(mine) == _seed(was)))

    return all(fresh(r) for r in ranks)


def with_cause(detail: str, component: str, now: Mapping[str, Any], ranks: Sequence[Any]) -> str:
    """``detail`` with the cause the resumed side gave for ``component`` on those ranks (``cause``), if any."""
    causes = [now[str(r)][component].get("cause") for r in ranks if component in now.get(str(r), {})]
    cause = next((c for c in causes if isinstance(c, str) and c), None)
    return f"{detail}: {cause}" if cause else detail


def unchecked_notes(gathered: Mapping[str, Mapping[str, Any]], label: Callable[[str], str]) -> list[dict[str, Any]]:
    """A note per component that some rank could not digest (an entry with ``why`` and no digest)."""
    ranks = sorted(gathered, key=int)
    out = []
    comps = sorted({c for r in ranks for c, e in gathered[r].items() if isinstance(e, Mapping) and "digest" not in e})
    for comp in comps:
        which = [int(r) for r in ranks if "digest" not in gathered[r].get(comp, {"digest": None})]
        why = gathered[str(which[0])][comp].get("why", "it could not be read")
        out.append({
            "component": comp, "kind": "unchecked", "ranks": which, "from_ranks": [], "severity": "note",
            "detail": f"the {label(comp)} is not checked on {_ranks_text(which, len(ranks))}: {why}",
        })  # fmt: skip
    return out


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
    where the entries carry their whole state as one, else by digest (the rules above).

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
