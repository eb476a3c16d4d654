"""Which rank each diverged tensor is resynced from: a pure function of the (identical) audit record.

``resync_src`` is a rank or ``"majority"``. With ``"majority"`` every tensor comes from a rank holding its
reference value. With a rank, that rank is the source for every tensor it holds the reference value of;
for a tensor where it holds a minority value (the others outvote it), the tensor is taken from a rank
holding the majority value instead, and a note says so: copying a minority value over the majority
would spread the divergence. A tie has no majority: the chosen rank (or, for ``"majority"``, the side
holding the lowest rank) decides, and the note names the tie.

Every rank computes the same plan from the same record, so every rank makes the same broadcasts in the
same order (ascending source rank).

>>> from weightsync_audit.reporting.record import Mismatch
>>> plan = plan_resync([Mismatch("w", "param", ranks=[0], reference_ranks=[1, 2])], 0)
>>> plan.sources, plan.notes[0][:46]
({1: ['w']}, 'resync_src=0 holds a minority value of w (rank')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence, Union

from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import brief_names, fmt_ranks

__all__ = ["ResyncSource", "ResyncPlan", "check_resync_src", "plan_resync"]

ResyncSource = Union[int, Literal["majority"]]
"""A rank of the group, or ``"majority"``: each tensor from a rank holding its reference value."""


def check_resync_src(src: object, argument: str = "resync_src") -> ResyncSource:
    """Validate a resync source: an integer rank >= 0 or ``"majority"``."""
    if src == "majority" and isinstance(src, str):
        return "majority"
    if isinstance(src, bool) or not isinstance(src, int) or src < 0:
        raise ValueError(f"{argument}={src!r}: must be a rank number >= 0 or 'majority'")
    return src


@dataclass(slots=True)
class ResyncPlan:
    """Source rank -> names to broadcast from it (ascending ranks), and what the record should say."""

    sources: dict[int, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """``3 tensor(s) from rank 0, 1 from rank 2``."""
        parts = [f"{len(names)} from rank {r}" for r, names in self.sources.items()]
        total = sum(len(n) for n in self.sources.values())
        return f"{total} tensor(s): " + ", ".join(parts) if parts else "nothing"


def plan_resync(mismatches: Sequence[Mismatch], src: ResyncSource) -> ResyncPlan:
    """The source of each mismatch's tensor (gradients and structure differences are left out)."""
    chosen: dict[int, list[str]] = {}
    outvoted: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    ties: dict[int, list[str]] = {}
    for m in mismatches:
        if m.kind in ("grad", "structure") or not m.reference_ranks:
            continue
        if src == "majority":
            source = m.reference_ranks[0]
        elif src in m.reference_ranks or (m.tie and src in m.ranks):
            source = src  # holds the reference value, or one side of a tie: the user's choice decides
        elif src in m.ranks:
            source = m.reference_ranks[0]
            outvoted.setdefault((source, tuple(m.reference_ranks)), []).append(m.name)
        else:
            source = m.reference_ranks[0]
        if m.tie:
            ties.setdefault(source, []).append(m.name)
        chosen.setdefault(source, []).append(m.name)
    plan = ResyncPlan({r: chosen[r] for r in sorted(chosen)})
    for (source, refs), names in outvoted.items():
        plan.notes.append(
            f"resync_src={src} holds a minority value of {brief_names(names)} ({fmt_ranks(refs)} hold the majority "
            f"value): resynced from rank {source}, a majority holder, instead"
        )
    for source, names in ties.items():
        plan.notes.append(
            f"tie vote on {brief_names(names)}: no majority, resynced from rank {source} "
            f"({'resync_src' if src != 'majority' else 'the side holding the lowest rank'})"
        )
    return plan
