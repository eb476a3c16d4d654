"""The rules a resume check compares by, beside :func:`~weightsync_audit.engine.checkpoints.resume_state.compare`.

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

>>> import torch
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
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["WHOLE_VALUE", "comparison_keys", "just_seeded", "reseeded_everywhere", "unchecked_notes", "with_cause"]

WHOLE_VALUE = ("data.position", "data.sampler")
"""Components whose ``value``, when they carry one that is not a text, is all that their digest covers."""

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
        if len(which) == len(ranks) and len(ranks) > 1:
            where = "every rank"
        else:
            where = ("rank " if len(which) == 1 else "ranks ") + ", ".join(map(str, which))
        out.append({
            "component": comp, "kind": "unchecked", "ranks": which, "from_ranks": [], "severity": "note",
            "detail": f"the {label(comp)} is not checked on {where}: {why}",
        })  # fmt: skip
    return out
