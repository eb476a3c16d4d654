"""What pinpoint answers (:class:`Pinpoint`): located from the gathered rings (:func:`locate`), and that answer while tensors drift within the tolerance.

>>> Pinpoint(state="exact", first_diverged_step=4, last_in_sync_step=3).first_diverged_step
4
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from weightsync_audit.reporting.record import PinpointState

__all__ = [
    "NO_STEP",
    "RING_HEADER",
    "Pinpoint",
    "Ring",
    "compared_steps",
    "decode_ring",
    "locate",
    "missing_at",
    "step_differs",
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
    """Each diverged tensor's own first diverged step, by ``kind:name``, where exact (:mod:`.tensor_dates`)."""


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
