"""What pinpoint answers (:class:`Pinpoint`), and that answer while tensors drift within the tolerance.

>>> Pinpoint(state="exact", first_diverged_step=4, last_in_sync_step=3).first_diverged_step
4
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync_audit.reporting.record import PinpointState

__all__ = ["Pinpoint", "with_drift"]


@dataclass(kw_only=True, slots=True)
class Pinpoint:
    """Where a divergence began, as found from every rank's ring (identical on every rank)."""

    state: PinpointState
    first_diverged_step: int | None = None
    last_in_sync_step: int | None = None
    """The last step known in sync (None: the rings do not tell)."""
    note: str | None = None


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
    if pin.state != "unseen" and drift.state == "exact" and d is not None and (new is None or d >= new):
        return pin  # the new difference came first (or at the same step): its own date is the answer
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
        state=drift.state, first_diverged_step=d, last_in_sync_step=drift.last_in_sync_step, note=note or None
    )
