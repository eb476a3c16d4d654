"""Divergences that appeared and healed between two audits, seen through the pinpoint rings.

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

from typing import Any, Sequence

import numpy as np

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.timeline.answer import compared_steps, decode_ring, step_differs
from weightsync_audit.engine.timeline.pinpoint import Pinpointer

__all__ = ["find_transient", "ring_word", "transient_from", "transient_note"]


def ring_word(pinpointer: Pinpointer | None) -> int:
    """The summary's ``ring`` word: this rank's trace since the last audit (0 without pinpoint)."""
    return 0 if pinpointer is None else pinpointer.ring.trace >> 1


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


def find_transient(comm: Comm, pinpointer: Pinpointer, names: Sequence[str]) -> dict[str, Any]:
    """Collective, off the healthy path: every rank calls it when the summaries' ring words differ."""
    rings = comm.exchange_bytes(pinpointer.ring.encode(recent=True), "the pinpoint rings")
    mine = b"" if pinpointer.tensors is None else pinpointer.tensors.tobytes()
    if pinpointer.tensors is not None and len(pinpointer.names) == len(pinpointer.tensors):
        names = pinpointer.names  # the manifest the traces were folded over (the audit's may have changed since)
    return transient_from(rings, comm.exchange_bytes(mine, "the per-tensor traces"), names)


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
