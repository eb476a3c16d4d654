"""Which rank each diverged tensor is resynced from: a pure function of the (identical) audit record.

``resync_src`` is a rank or ``"majority"``. With ``"majority"`` every tensor comes from a rank holding its
reference value. With a rank, that rank is the source for every tensor it holds the reference value of;
for a tensor where it holds a minority value (the others outvote it), the tensor is taken from a rank
holding the majority value instead, and a note says so: copying a minority value over the majority
would spread the divergence. A tie has no majority: the chosen rank (or, for ``"majority"``, the side
holding the lowest rank) decides, and the note names the tie.

Values come first: a source is never a rank whose copy holds NaN or inf (``Mismatch.nonfinite``, counted
on every rank and gathered) where another rank's copy is finite. Such a tensor is taken from a finite
copy instead (on a tie, the finite side wins), and a note says so; when no copy is finite,
:class:`~weightsync_audit.ResyncError` names the tensors, and nothing moves.

Gradients that differ are resynced too (``ResyncPlan.grads``), from the same kind of source, so that
the step about to be taken is the same everywhere.

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

from weightsync_audit.compat_engines import MASTER_CHECK, STATE_CHECK
from weightsync_audit.errors import ResyncError
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import brief_names, fmt_ranks

__all__ = ["DERIVED", "is_derived", "ResyncSource", "ResyncPlan", "check_resync_src", "plan_resync"]

DERIVED = frozenset({MASTER_CHECK})
"""Entries that are checks drawn from other tensors, not tensors of their own: never copied (resyncing the
tensors they are drawn from restores them, which the confirming audit reads again)."""


def is_derived(name: str) -> bool:
    """Whether ``name`` is a check drawn from other tensors (:data:`DERIVED`, or an FSDP1
    ``fsdp1.optimizer_state_held.<parameter>``), never copied by a resync.

    >>> is_derived("fsdp1.optimizer_state_held.0.weight"), is_derived("0.weight")
    (True, False)
    """
    return name in DERIVED or name.startswith(STATE_CHECK + ".")


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
    grads: dict[int, list[str]] = field(default_factory=dict)
    """Source rank -> parameters whose gradients are broadcast from it."""

    def describe(self) -> str:
        """``3 tensor(s) from rank 0, 1 from rank 2`` (gradients counted as tensors too)."""
        parts = []
        for r in self.ranks():
            n, g = len(self.sources.get(r, ())), len(self.grads.get(r, ()))
            parts.append(f"{n + g} from rank {r}" + (f" ({g} gradient(s))" if g else ""))
        total = sum(len(n) for n in self.sources.values()) + sum(len(n) for n in self.grads.values())
        return f"{total} tensor(s): " + ", ".join(parts) if parts else "nothing"

    def ranks(self) -> list[int]:
        """Every source rank, ascending (the order of the broadcasts)."""
        return sorted(set(self.sources) | set(self.grads))

    def receivers(self, mismatches: Sequence[Mismatch]) -> list[int]:
        """The ranks this plan repaired among ``mismatches`` (those it was made from): for each tensor moved,
        the ranks that held another value than its source.

        >>> tie = Mismatch("w", "param", [1], [0], detail="tie vote: rank 0 vs rank 1, no majority")
        >>> ResyncPlan({1: ["w"]}).receivers([tie])
        [0]
        """
        source = {(kind, n): r for kind, plan in (("param", self.sources), ("grad", self.grads))
                  for r, names in plan.items() for n in names}  # fmt: skip
        out: set[int] = set()
        for m in mismatches:
            s = source.get(("grad" if m.kind == "grad" else "param", m.name))
            if s is not None:
                out.update(m.ranks if s in m.reference_ranks else [*m.reference_ranks, *(r for r in m.ranks if r != s)])
        return sorted(out)


def _finite_source(m: Mismatch, source: int) -> int | None:
    """``source``, unless its copy holds NaN/inf: then the first finite copy (reference side first);
    ``None`` when every copy holds NaN/inf."""
    bad = m.nonfinite or {}
    if source not in bad:
        return source
    return next((r for r in (*m.reference_ranks, *m.ranks) if r not in bad), None)


def plan_resync(mismatches: Sequence[Mismatch], src: ResyncSource, *, tie_chosen_by: str | None = None) -> ResyncPlan:
    """The source of each mismatch's tensor (structure differences are left out). ``tie_chosen_by``: what
    chose ``src`` for a tie, in the note (:func:`~weightsync_audit.engine.culprit.resync_source`'s words).

    Raises :class:`~weightsync_audit.ResyncError` naming the tensors of which no copy is finite.
    """
    chosen: dict[int, list[str]] = {}
    grads: dict[int, list[str]] = {}
    outvoted: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    ties: dict[int, list[str]] = {}
    finite: dict[tuple[int, int], list[str]] = {}
    hopeless: list[str] = []
    for m in mismatches:
        if m.kind == "structure" or not m.reference_ranks or is_derived(m.name):
            continue
        if src == "majority":
            source = m.reference_ranks[0]
        elif src in m.reference_ranks or (m.tie and src in m.ranks):
            source = src  # holds the reference value, or one side of a tie: the user's choice decides
        elif src in m.ranks:
            source = m.reference_ranks[0]
            if _finite_source(m, source) == source:
                outvoted.setdefault((source, tuple(m.reference_ranks)), []).append(m.name)
        else:
            source = m.reference_ranks[0]
        safe = _finite_source(m, source)
        if safe is None:
            hopeless.append(f"{m.kind} {m.name}")
            continue
        if safe != source:
            finite.setdefault((source, safe), []).append(m.name)
            source = safe
        elif m.tie:
            ties.setdefault(source, []).append(m.name)
        (grads if m.kind == "grad" else chosen).setdefault(source, []).append(m.name)
    if hopeless:
        raise ResyncError(
            f"cannot resync {brief_names(hopeless)}: every rank's copy holds NaN or inf, so no rank is a "
            "safe source; restore a checkpoint",
            None,
            untouched=hopeless,
        )
    plan = ResyncPlan({r: chosen[r] for r in sorted(chosen)}, grads={r: grads[r] for r in sorted(grads)})
    for (unsafe, source), names in finite.items():
        plan.notes.append(
            f"rank {unsafe} holds NaN/inf in {brief_names(names)} where rank {source} holds finite values: "
            f"resynced from rank {source}, never from a non-finite copy"
        )
    for (source, refs), names in outvoted.items():
        plan.notes.append(
            f"resync_src={src} holds a minority value of {brief_names(names)} ({fmt_ranks(refs)} hold the majority "
            f"value): resynced from rank {source}, a majority holder, instead"
        )
    default = "resync_src" if src != "majority" else "the side holding the lowest rank"
    for source, names in ties.items():
        plan.notes.append(
            f"tie vote on {brief_names(names)}: no majority, resynced from rank {source} ({tie_chosen_by or default})"
        )
    return plan
