"""Pinpoint: the exact step at which replicas parted, even when no audit ran at that step.

At every optimizer step each rank digests, locally and without any communication, what the audit
covers (one 64-bit digest over every audited tensor, from the audit's own manifest and digests) and keeps ``(step, digest)``
in a bounded :class:`StepRing`. An in-sync audit trims the ring: what came before it is known good.
When an audit finds a divergence, the ranks exchange their rings (one message each, through the
audit's channel) and :func:`locate` finds, from the same gathered rings on every rank, the first step
whose digests disagree: ``first_diverged_step``; the step before it, where they still agreed, is the
exact ``last_in_sync_step``.

Never a guess: a step counts as in sync only when its full digests agreed (or an in-sync full audit
vouches for it). When the ring lost the steps that would tell (``overflow``), when every recorded step
agreed (``unseen``: the change came after the last recorded step, e.g. outside an optimizer step), or
with sampled per-step digests (``sampled``: the divergence showed at that step and may have begun
earlier), or when the very first recorded step already differed with nothing before it known good
(``earlier``), the result says so and leaves ``first_diverged_step`` null.

>>> ring = StepRing(capacity=8)
>>> for step, d in [(1, 10), (2, 20), (3, 30)]:
...     ring.record_digest(step, d)
>>> other = StepRing(capacity=8)
>>> for step, d in [(1, 10), (2, 21), (3, 31)]:
...     other.record_digest(step, d)
>>> p = locate([ring.encode(), other.encode()])
>>> p.state, p.first_diverged_step, p.last_in_sync_step
('exact', 2, 1)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.hashing.digest import overall_digest
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest
from weightsync_audit.reporting.record import AuditResult, PinpointState

__all__ = [
    "DEFAULT_RING",
    "Pinpoint",
    "Pinpointer",
    "PinpointState",
    "StepRing",
    "locate",
    "mark_pinpoint",
]


DEFAULT_RING = 1024
"""Steps a ring holds by default: 16 bytes each (16 KiB); enough for an audit every 1,000 steps."""

_NONE = -(1 << 63)  # "no step" in the encoded ring (steps may be any int64 the user passes)
_HEADER = 4  # dropped, anchor, slices, count


@dataclass(kw_only=True, slots=True)
class Pinpoint:
    """Where a divergence began, as found from every rank's ring (identical on every rank)."""

    state: PinpointState
    first_diverged_step: int | None = None
    last_in_sync_step: int | None = None
    """The last step known in sync (None: the rings do not tell)."""
    note: str | None = None


class StepRing:
    """This rank's ``(step, digest)`` per optimizer step since the last in-sync audit, at most ``capacity``.

    ``anchor``: the step of the last in-sync full audit (every rank held the same values then).
    ``dropped``: entries pushed out since then because the ring was full.
    """

    def __init__(self, capacity: int = DEFAULT_RING, slices: int = 1) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"pinpoint_ring={capacity!r}: must be an integer >= 1 (steps kept between audits)")
        self.capacity = capacity
        self.slices = slices
        self.entries: deque[tuple[int, int]] = deque()
        self.dropped = 0
        self.anchor: int | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def record_digest(self, step: int, digest: int) -> None:
        """Remember ``digest`` for ``step``; the same step again (gradient accumulation) replaces it."""
        step = int(step)
        if self.entries and self.entries[-1][0] == step:
            self.entries[-1] = (step, int(digest))
            return
        self.entries.append((step, int(digest)))
        if len(self.entries) > self.capacity:
            self.entries.popleft()
            self.dropped += 1

    def mark_in_sync(self, step: int | None, *, proven: bool = True) -> None:
        """An audit at ``step`` found every rank in sync: forget what came before it.

        ``proven=False`` (a sampled audit, which saw only part of the values) keeps the ring as it is.
        """
        if step is None or not proven:
            return
        step = int(step)
        while self.entries and self.entries[0][0] < step:
            self.entries.popleft()
        self.dropped = 0
        self.anchor = step

    def encode(self) -> bytes:
        head = [self.dropped, _NONE if self.anchor is None else self.anchor, self.slices, len(self.entries)]
        steps = [s for s, _ in self.entries]
        digests = [d for _, d in self.entries]
        return np.array(head + steps + digests, dtype=np.int64).tobytes()


@dataclass(slots=True)
class _Ring:
    dropped: int
    anchor: int | None
    slices: int
    steps: list[int]
    digests: list[int]


def _decode(blob: bytes) -> _Ring:
    a = np.frombuffer(blob, dtype=np.int64)
    if len(a) < _HEADER or len(a) != _HEADER + 2 * int(a[3]):
        raise ValueError(f"a pinpoint ring of {len(blob)} bytes does not decode")
    n = int(a[3])
    anchor = int(a[1])
    return _Ring(
        int(a[0]),
        None if anchor == _NONE else anchor,
        int(a[2]),
        a[_HEADER : _HEADER + n].tolist(),
        a[_HEADER + n :].tolist(),
    )


def locate(blobs: Sequence[bytes]) -> Pinpoint:
    """The first step whose digests differ across the gathered rings (one per rank, in rank order)."""
    rings = [_decode(b) for b in blobs]
    sampled = any(r.slices > 1 for r in rings)
    by_step = [dict(zip(r.steps, r.digests)) for r in rings]
    common = sorted(set(by_step[0]).intersection(*by_step[1:])) if by_step else []
    uneven = any(set(s) != set(common) for s in by_step)
    dropped = any(r.dropped for r in rings)
    anchors = {r.anchor for r in rings}
    anchor = anchors.pop() if len(anchors) == 1 else None
    capacity_note = "raise pinpoint_ring to at least the number of steps between audits"
    first = next((i for i, s in enumerate(common) if len({d[s] for d in by_step}) > 1), None)
    if first is None:
        if not common:
            return Pinpoint(
                state="unseen",
                note="pinpoint: no optimizer step was recorded on every rank since the last in-sync audit "
                "(is record_step called each step?)",
            )
        last = common[-1]
        return Pinpoint(
            state="unseen",
            last_in_sync_step=None if sampled else last,
            note=f"pinpoint: every rank's digests agreed at every recorded step up to step {last}; the change "
            "came after it, outside a recorded optimizer step",
        )
    step = common[first]
    if sampled:
        return Pinpoint(
            state="sampled",
            first_diverged_step=step,
            note=f"pinpoint (sampled per-step digests): the replicas differed at step {step}; the divergence "
            "may have begun earlier, after the last in-sync audit",
        )
    if first > 0:
        before = common[first - 1]
        note = None
        if uneven:
            note = "pinpoint: the ranks recorded different steps; only steps recorded on every rank were compared"
        return Pinpoint(state="exact", first_diverged_step=step, last_in_sync_step=before, note=note)
    if not dropped and anchor is not None and anchor < step and not uneven:
        # Nothing lost since an in-sync audit at `anchor`, and the first step recorded after it differs.
        return Pinpoint(state="exact", first_diverged_step=step, last_in_sync_step=anchor)
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


class Pinpointer:
    """An :class:`~weightsync_audit.Auditor`'s pinpoint: its ring, and the answer for the current divergence.

    Once a divergence is located, the ring stops recording (nothing more to learn, nothing to pay per
    step) and later divergent audits reuse the answer, until an audit finds the replicas in sync again.
    """

    def __init__(self, capacity: int = DEFAULT_RING, slices: int = 1) -> None:
        self.ring = StepRing(capacity, slices)
        self.found: Pinpoint | None = None

    def record_step(self, step: int, prepare: Callable[[], PreparedManifest], method: str = "auto") -> int | None:
        """Digest, locally, everything the audit's manifest (``prepare()``) covers after optimizer ``step``;
        the digest when it covers every byte (no sampling), else ``None``."""
        if self.found is not None:
            return None  # this divergence is located already: nothing to record until the replicas agree again
        prepared, n = prepare(), self.ring.slices  # the audit's cached manifest: no per-tensor work per step
        digests = prepared.digests(slice_index=step % n, slices=n, method=method)
        digest = overall_digest(digests, prepared.structure)
        self.record(step, digest)
        return digest if n == 1 else None

    def record(self, step: int, digest: int) -> None:
        """This rank's digest of everything audited after ``step`` (slice ``step % slices`` when sampled)."""
        if self.found is None:
            self.ring.record_digest(step, digest)

    def in_sync(self, step: int | None, *, proven: bool = True) -> None:
        """Every rank held the same values at ``step`` (an in-sync audit, or a confirmed resync)."""
        self.found = None
        self.ring.mark_in_sync(step, proven=proven)

    @property
    def position(self) -> str:
        """Part of the audit position: ranks must agree on whether the rings are exchanged again."""
        return " pinpoint=located" if self.found is not None else ""

    def settle(self, comm: Comm, diverged: bool, step: int | None, proven: bool) -> Pinpoint | None:
        """After an audit's verdict (the same on every rank): locate a divergence, or trim the ring."""
        if diverged:
            return self.diverged(comm)
        self.in_sync(step, proven=proven)
        return None

    def diverged(self, comm: Comm) -> Pinpoint:
        """Collective: every rank calls it when an audit found a divergence; the same answer everywhere."""
        if self.found is None:
            self.found = locate(comm.exchange_bytes(self.ring.encode(), "the pinpoint rings"))
        return self.found


def mark_pinpoint(result: AuditResult, pin: Pinpoint | None) -> None:
    """Write what pinpoint found into a divergent ``result`` (``pinpoint: "off"`` without it)."""
    if result.in_sync:
        return
    result.pinpoint = "off" if pin is None else pin.state
    if pin is not None:
        result.first_diverged_step = pin.first_diverged_step
        if pin.last_in_sync_step is not None:
            result.last_in_sync_step = pin.last_in_sync_step
        if pin.note:
            result.notes.append(pin.note)
