"""What pinpoint answers (:class:`Pinpoint`): located from the gathered rings (:func:`locate`), and that answer
while tensors drift within the tolerance; each diverged tensor dated to its own first step (:class:`TensorRing`,
:func:`date_tensors`).

The pinpoint ring keeps one digest per step, over everything audited: it dates the *first* difference of
all. A bug planted at step 12 among a tensor drifting since step 3 would read as step 3 for both. So each
rank also keeps, per recorded step, the digest vector of every audited tensor (the one the step's digest
is folded from: no extra hashing), in a ring bounded by bytes (:data:`TENSOR_RING_BYTES`; the oldest
steps go first). When an audit finds a divergence, every rank sends the columns of the diverged tensors
only, and the coordinator dates each one, exactly as the pinpoint ring is read: the first step whose
digests differ, or that some rank did not record; ``exact`` only when a step before it agreed (or an
in-sync audit vouches for the step before the first one kept). A tensor it cannot date so is left
undated (the mismatch's ``first_diverged_step`` is null).

>>> a, b = TensorRing(1 << 20), TensorRing(1 << 20)
>>> for step, x, y in [(1, [10, 20], [10, 20]), (2, [11, 21], [12, 21]), (3, [13, 22], [14, 23])]:
...     a.record(step, np.array(x, np.int64), 7)
...     b.record(step, np.array(y, np.int64), 7)
>>> uids = ["param:w", "param:b"]
>>> dates_from([a.columns([0, 1], None), b.columns([0, 1], None)], uids)
{'param:w': 2, 'param:b': 3}

>>> Pinpoint(state="exact", first_diverged_step=4, last_in_sync_step=3).first_diverged_step
4

Divergences that appeared and healed between two audits, seen through the pinpoint rings.

Each rank folds every ``(step, digest)`` it records into one word (:attr:`StepRing.trace
<weightsync_audit.engine.timeline.pinpoint.StepRing.trace>`), which travels in the audit's fixed-size
summary. When the summaries agree on the values but not on that word, the replicas agree now yet
differed (or recorded other steps) at some step since the last audit: a one-ulp flip rounded away, a
corruption that turned every rank's values into the same NaNs. Only then are the rings exchanged
(and each rank's per-tensor traces, to name the tensors), and the record, still ``in_sync`` (it
describes now), carries ``transient``.

>>> from weightsync_audit.engine.timeline.pinpoint import StepRing
>>> a, b = StepRing(8), StepRing(8)
>>> for step, da, db in [(1, 10, 10), (2, 20, 21), (3, 30, 31), (4, 40, 40)]:
...     a.record_digest(step, da)
...     b.record_digest(step, db)
>>> import numpy as np
>>> traces = [np.array([7, 8], np.uint64).tobytes(), np.array([7, 9], np.uint64).tobytes()]
>>> transient_from([a.encode(), b.encode()], traces, ["w", "b"])
{'first_diverged_step': 2, 'last_diverged_step': 3, 'names': ['b']}
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from weightsync_audit.channel.star import Comm
from weightsync_audit.reporting.record import PinpointState

__all__ = [
    "compared_steps",
    "date_tensors",
    "dates_from",
    "decode_ring",
    "locate",
    "MAX_DATED",
    "missing_at",
    "NO_STEP",
    "Pinpoint",
    "Ring",
    "RING_HEADER",
    "step_differs",
    "transient_from",
    "transient_note",
    "TENSOR_RING_BYTES",
    "TensorRing",
    "with_drift",
]
NO_STEP = -(1 << 63)
""""No step" in an encoded ring (steps may be any int64 the user passes)."""
RING_HEADER = 4
"""Words before an encoded ring's steps: dropped, anchor, slices, count."""


@dataclass(kw_only=True, slots=True)
class Pinpoint:
    """Where a divergence began, as found from every rank's ring (identical on every rank)."""

    state: PinpointState
    first_diverged_step: int | None = None
    last_in_sync_step: int | None = None
    """The last step known in sync (None: the rings do not tell)."""
    note: str | None = None
    tensor_steps: dict[str, int] | None = None
    """Each diverged tensor's own first diverged step, by ``kind:name``, where exact (:func:`date_tensors`)."""


def with_drift(drift: Pinpoint, pin: Pinpoint) -> Pinpoint:
    """The answer while tensors found within the tolerance (dated by ``drift``) are left out of the per-step
    digests, from ``pin`` (located over the rest): the first step the bytes differed, never an ``exact``
    step after the drift's; the later difference's own date goes in the note.

    >>> drift = Pinpoint(state="exact", first_diverged_step=3, last_in_sync_step=2)
    >>> later = with_drift(drift, Pinpoint(state="exact", first_diverged_step=12, last_in_sync_step=11))
    >>> later.state, later.first_diverged_step, later.last_in_sync_step
    ('exact', 3, 2)
    """
    d, new = drift.first_diverged_step, pin.first_diverged_step
    dated = {**(pin.tensor_steps or {}), **(drift.tensor_steps or {})} or None  # the drift's tensors: its dates
    if pin.state != "unseen" and drift.state == "exact" and d is not None and (new is None or d >= new):
        # the new difference came first (or at the same step): its own date is the answer
        return Pinpoint(state=pin.state, first_diverged_step=new, last_in_sync_step=pin.last_in_sync_step,
                        note=pin.note, tensor_steps=dated)  # fmt: skip
    left = "the tensors found within the tolerance at an earlier audit are left out of the per-step digests since"
    if pin.state == "unseen":
        said = f"{left}, and nothing else differed at a recorded step: the tensors beyond the tolerance now were "
        said += "among them; when they went beyond it is not known"
    else:
        since = f"step {d}" if d is not None else "before the first step recorded"
        said = f"within the tolerance the replicas have differed since {since}; the difference found since ({left}) "
        said += f"began at step {new} ({pin.state}" + (
            f", the last step before it {pin.last_in_sync_step})" if pin.last_in_sync_step is not None else ")"
        )
    note = "; ".join(n for n in (drift.note, f"pinpoint: {said}", pin.note) if n)
    return Pinpoint(
        state=drift.state,
        first_diverged_step=d,
        last_in_sync_step=drift.last_in_sync_step,
        note=note or None,
        tensor_steps=dated,
    )


@dataclass(slots=True)
class Ring:
    dropped: int
    anchor: int | None
    slices: int
    steps: list[int]
    digests: list[int]


def decode_ring(blob: bytes) -> Ring:
    a = np.frombuffer(blob, dtype=np.int64)
    if len(a) < RING_HEADER or len(a) != RING_HEADER + 2 * int(a[3]):
        raise ValueError(f"a pinpoint ring of {len(blob)} bytes does not decode")
    n = int(a[3])
    anchor = int(a[1])
    return Ring(
        int(a[0]),
        None if anchor == NO_STEP else anchor,
        int(a[2]),
        a[RING_HEADER : RING_HEADER + n].tolist(),
        a[RING_HEADER + n :].tolist(),
    )


def compared_steps(rings: Sequence[Ring]) -> list[int]:
    """The steps to compare: every step some rank recorded, from the first one every ring still holds.

    A step recorded on some ranks only is a difference at that step (a skipped optimizer step); steps
    before the latest start of a ring that overflowed are lost on that rank, so they are not compared.
    """
    union = sorted(set().union(*(r.steps for r in rings)))
    if any(r.dropped for r in rings):
        start = max((r.steps[0] for r in rings if r.steps), default=None)
        union = [s for s in union if start is None or s >= start]
    return union


def step_differs(by_step: Sequence[dict[int, int]], step: int) -> bool:
    """Some rank lacks ``step``, or the ranks' digests at it differ."""
    first = by_step[0].get(step)
    return any(d.get(step, NO_STEP) != first or step not in d for d in by_step)


def missing_at(by_step: Sequence[dict[int, int]], step: int) -> list[int]:
    """The ranks (positions) that recorded no ``step``."""
    return [r for r, d in enumerate(by_step) if step not in d]


def locate(blobs: Sequence[bytes], ranks: Sequence[int] | None = None) -> Pinpoint:
    """The first step whose digests differ, or that some rank did not record, across the gathered rings.

    One ring per rank, in rank order; ``ranks`` names them (global ranks) in notes. ``exact`` only when
    every rank holds the same steps up to that step, each agreeing.
    """
    rings = [decode_ring(b) for b in blobs]
    names = list(ranks) if ranks is not None else list(range(len(rings)))
    sampled = any(r.slices > 1 for r in rings)
    by_step = [dict(zip(r.steps, r.digests)) for r in rings]
    steps = compared_steps(rings)
    dropped = any(r.dropped for r in rings)
    anchors = {r.anchor for r in rings}
    anchor = anchors.pop() if len(anchors) == 1 else None
    capacity_note = "raise pinpoint_ring to at least the number of steps between audits"
    first = next((i for i, s in enumerate(steps) if step_differs(by_step, s)), None)
    if first is None:
        if not steps:
            return Pinpoint(
                state="unseen",
                note=None  # no step recorded yet (a check right after a load): nothing to date
                if anchor is None
                else f"pinpoint: no optimizer step was recorded on every rank since step "
                f"{anchor}, when they were last known in sync: the replicas parted outside a recorded step",
            )
        last = steps[-1]
        return Pinpoint(
            state="unseen",
            last_in_sync_step=None if sampled else last,
            note=f"pinpoint: every rank's digests agreed at every recorded step up to step {last}; the change "
            "came after it, outside a recorded optimizer step",
        )
    step = steps[first]
    lacking = missing_at(by_step, step)
    missing = (
        f"pinpoint: rank(s) {[names[r] for r in lacking]} recorded no step {step} while the others did "
        "(a skipped optimizer step?): the replicas parted there"
        if lacking
        else None
    )
    if sampled:
        return Pinpoint(
            state="sampled",
            first_diverged_step=step,
            note=f"pinpoint (sampled per-step digests): the replicas differed at step {step}; the divergence "
            "may have begun earlier, after the last in-sync audit" + (f"; {missing}" if missing else ""),
        )
    if first > 0:
        return Pinpoint(state="exact", first_diverged_step=step, last_in_sync_step=steps[first - 1], note=missing)
    if not dropped and anchor is not None and anchor < step:
        # Nothing lost since an in-sync audit at `anchor`, and the first step recorded after it differs.
        return Pinpoint(state="exact", first_diverged_step=step, last_in_sync_step=anchor, note=missing)
    if dropped:
        return Pinpoint(
            state="overflow",
            note=f"pinpoint ring overflowed: the replicas already differed at step {step}, the oldest step it "
            f"still held; the divergence began before it; {capacity_note}",
        )
    return Pinpoint(
        state="earlier",
        note=f"pinpoint: the replicas already differed at step {step}, the first step recorded, and no "
        "earlier step is known to have agreed",
    )


TENSOR_RING_BYTES = 32 << 20
"""Per-tensor digests a rank keeps at most (8 bytes per tensor per step): 32 MiB."""
MAX_DATED = 256
"""Diverged tensors dated at most per audit (the first ones in the record's order)."""
_NONE = -(1 << 63)


class TensorRing:
    """This rank's per-step digest vectors (one 64-bit word per audited tensor) since the last in-sync audit."""

    def __init__(self, budget: int = TENSOR_RING_BYTES) -> None:
        self.budget = budget
        self.steps: deque[int] = deque()
        self.vectors: deque[np.ndarray] = deque()
        self.structure: int | None = None
        self.dropped = 0
        """Steps lost since the last in-sync audit (the budget, or a change of the audited set)."""

    def record(self, step: int, digests: np.ndarray, structure: int) -> None:
        """The digests of every audited tensor after optimizer ``step`` (the same step again replaces it)."""
        if structure != self.structure:  # another audited set: its columns do not line up with the kept ones
            self.dropped += len(self.steps)
            self.steps.clear()
            self.vectors.clear()
            self.structure = structure
        if self.steps and self.steps[-1] == step:
            self.vectors[-1] = digests.copy()
            return
        self.steps.append(int(step))
        self.vectors.append(digests.copy())
        while len(self.steps) > 1 and len(self.steps) * digests.nbytes > self.budget:
            self.steps.popleft()
            self.vectors.popleft()
            self.dropped += 1

    def trim(self, step: int) -> None:
        """An in-sync audit at ``step`` vouches for it: what came before is forgotten."""
        while self.steps and self.steps[0] < step:
            self.steps.popleft()
            self.vectors.popleft()
        self.dropped = 0

    def restart(self) -> None:
        """Every rank was made to hold the same values (a resync), or the set dated changed: start afresh."""
        self.steps.clear()
        self.vectors.clear()
        self.dropped = 0

    def columns(self, positions: Sequence[int], anchor: int | None) -> bytes:
        """The kept steps and, for each of ``positions`` (manifest order; -1: not held here), its digest per step."""
        n = len(self.steps)
        size = len(self.vectors[0]) if n else 0
        matrix = np.full((n, len(positions)), _NONE, dtype=np.int64)
        for j, pos in enumerate(positions):
            if 0 <= pos < size:
                matrix[:, j] = [v[pos] for v in self.vectors]
        head = [self.dropped, _NONE if anchor is None else anchor, n, len(positions)]
        return np.concatenate([np.array(head + list(self.steps), np.int64), matrix.reshape(-1)]).tobytes()


def _decode(blob: bytes) -> tuple[int, int | None, list[int], np.ndarray]:
    a = np.frombuffer(blob, dtype=np.int64)
    dropped, anchor, n, m = (int(x) for x in a[:4])
    steps = a[4 : 4 + n].tolist()
    return dropped, None if anchor == _NONE else anchor, steps, a[4 + n : 4 + n + n * m].reshape(n, m)


def dates_from(blobs: Sequence[bytes], uids: Sequence[str]) -> dict[str, int]:
    """From every rank's :meth:`TensorRing.columns` (rank order): each tensor's first diverged step, where exact."""
    decoded = [_decode(b) for b in blobs]
    anchors = {d[1] for d in decoded}
    anchor = anchors.pop() if len(anchors) == 1 else None
    dropped = any(d[0] for d in decoded)
    by_step = [dict(zip(d[2], range(len(d[2])))) for d in decoded]
    steps = sorted(set().union(*(d[2] for d in decoded)))
    if dropped:  # steps before the latest start of a ring that lost some are not compared
        start = max((d[2][0] for d in decoded if d[2]), default=None)
        steps = [s for s in steps if start is None or s >= start]
    out: dict[str, int] = {}
    for j, uid in enumerate(uids):
        first = None
        for i, s in enumerate(steps):
            cells = [d[3][at[s], j] if s in at else None for d, at in zip(decoded, by_step)]
            if _NONE in cells:
                break  # a rank does not hold this tensor: not dated
            if None in cells or len(set(cells)) > 1:
                first = i
                break
        if first is None:
            continue
        s = steps[first]
        if first > 0 or (not dropped and anchor is not None and anchor < s):
            out[uid] = s
    return out


def date_tensors(
    comm: Comm, ring: TensorRing, positions: Sequence[int], uids: Sequence[str], anchor: int | None
) -> dict[str, int]:
    """Collective, on a divergence: every rank sends the columns of the diverged tensors (``positions`` in its
    manifest, ``uids`` the same on every rank); the coordinator dates them; every rank gets the same dates."""

    def rule(parts: list[bytes]) -> bytes:
        try:
            return json.dumps(dates_from(parts, uids)).encode()
        except Exception:  # noqa: BLE001 - undated, never a failed audit
            return b"{}"

    return {
        str(k): int(v)
        for k, v in json.loads(comm.decide(ring.columns(positions, anchor), rule, "the tensor dates")).items()
    }


def transient_from(rings: Sequence[bytes], tensors: Sequence[bytes], names: Sequence[str]) -> dict[str, Any]:
    """From every rank's ring and per-tensor traces (rank order): the diverged steps and the tensors."""
    decoded = [decode_ring(b) for b in rings]
    by_step = [dict(zip(r.steps, r.digests)) for r in decoded]
    diverged = [s for s in compared_steps(decoded) if step_differs(by_step, s)]
    vectors = [np.frombuffer(b, dtype=np.uint64) for b in tensors]
    found: list[str] = []
    why = None
    if vectors and len({len(v) for v in vectors}) == 1 and len(vectors[0]) == len(names):
        table = np.stack(vectors)
        found = [names[j] for j in np.nonzero(~(table == table[0]).all(axis=0))[0].tolist()]
    if not found:
        why = _why_unnamed(vectors, names, by_step, diverged)
    out: dict[str, Any] = {
        "first_diverged_step": diverged[0] if diverged else None,
        "last_diverged_step": diverged[-1] if diverged else None,
        "names": found,
    }
    if why:
        out["why"] = why  # for the note only; the record's field keeps its three keys
    return out


def _why_unnamed(
    vectors: Sequence[np.ndarray], names: Sequence[str], by_step: Sequence[dict[int, int]], diverged: Sequence[int]
) -> str:
    """Why no tensor can be named, in words (never an unexplained empty list)."""
    lacking = sorted({r for s in diverged for r, d in enumerate(by_step) if s not in d})
    if lacking:
        return f"rank(s) {lacking} did not record every step the others did: the steps taken differed"
    empty = [r for r, v in enumerate(vectors) if not len(v)]
    if empty:
        return f"rank(s) {empty} kept no per-tensor trace since the last audit"
    if len({len(v) for v in vectors}) != 1 or (vectors and len(vectors[0]) != len(names)):
        return "the ranks' per-tensor traces do not line up (the audited tensors changed differently)"
    return "every tensor's folded trace agrees: the difference was in the order or number of steps recorded"


def transient_note(t: dict[str, Any]) -> str:
    """The note a record with ``transient`` carries."""
    first, last = t["first_diverged_step"], t["last_diverged_step"]
    when = "at a step the ring no longer holds" if first is None else f"from step {first} to step {last}"
    what = ", ".join(t["names"][:5]) + (f" and {len(t['names']) - 5} more" if len(t["names"]) > 5 else "")
    if not what:
        what = "no tensor named: " + (t.get("why") or "the per-tensor traces agree")
    return (
        f"transient divergence: the replicas differed {when} ({what}) and agree again "
        "now; a difference that heals by itself points at silent data corruption or a non-finite value"
    )
