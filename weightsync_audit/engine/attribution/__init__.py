"""Attribution: which rank is wrong, and whether it is the machine, told even between two replicas.

A vote needs a majority; two replicas never have one. Each rank's own timeline does: between two
optimizer steps its parameters and optimizer state must not change (:mod:`.watch`, at rest); from the
same reduced gradients and the same pre-step state every rank's update must give the same bytes, and
each rank can replay its own (:mod:`.replay`); the reduced gradient buckets must be equal everywhere
(:mod:`.replay`). Each rank records these locally, without a message, and only an audit that found
a divergence exchanges the records (:mod:`.settle`) and decides, from the same gathered data on every
rank, whom to blame and why (:mod:`.blame`). What to record is one :class:`AttributionConfig`, here.

Who is wrong, whatever named it, is one pure function of the vote's majority and the current blame, also
here: :func:`culprit`. Everything that names a rank as the wrong one reads it, so that a record never blames
one rank while its repair copies from it or its evict file names the other: the resync source on a tie
(:func:`resync_source`, for :mod:`~weightsync_audit.engine.respond`), the blame by vote
(:func:`~weightsync_audit.engine.attribution.blame.vote_blame`), the machines handed on for eviction
(:mod:`~weightsync_audit.integrations.evict`) and the "machine" wording of the hints
(:func:`~weightsync_audit.engine.measure.finite.persistent_hints`). The rules, in order:

1. attribution's blame, when it names ranks from their own per-step records (any evidence but the vote),
   names them; it is evidence about their *machine* only when it is hardware-suspect;
2. else a strict majority on every differing tensor names the ranks outside it: evidence that they hold
   the odd value, not that their machine is at fault;
3. else (a tie, or no strict majority, and nothing else) no rank is named: no eviction, and a resync keeps
   ``resync_src`` and says that it was chosen without evidence.

Whatever the vote, a rank whose second read of a tensor gave other bytes (``stability == "unstable"``) is
evidence about its machine. The blame read is the current one: the audit's own, about the divergence in
front of it (an earlier divergence's blame is dropped when the replicas agree again or a repair is
confirmed).

>>> tie = Mismatch("w", "param", [1], [0], detail="tie vote: rank 0 vs rank 1, no majority")
>>> culprit([tie], None).ranks
()
>>> flip = {"ranks": [0], "evidence": "at_rest_change", "hardware_suspect": True, "detail": "w changed"}
>>> culprit([tie], flip).ranks, culprit([tie], flip).machine
((0,), (0,))
>>> culprit([Mismatch("w", "param", [2], [0, 1])], None).ranks
(2,)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import fmt_ranks

__all__ = [
    "AttributionConfig",
    "Culprit",
    "RECHECK_BYTES",
    "check_attribution",
    "culprit",
    "resync_source",
    "strict_majority",
]


RECHECK_BYTES = 16 << 20
"""The replay's default budget per optimizer step: 16 MiB copied (parameters, gradients, optimizer state)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class AttributionConfig:
    """What each rank records, locally, to name the corrupted rank and tell the machine from the software.

    >>> AttributionConfig(recheck=8).fingerprint()
    ' attribution=rest,recheck/8/16777216'
    """

    at_rest: bool = True
    """Digest the parameters and optimizer state right before each optimizer step and compare them with
    this rank's own digests after the step before: a change while at rest (a bit flip, a stray write)."""
    collective: bool = False
    """A DDP communication hook digests every reduced gradient bucket (compared across ranks at a
    divergent audit: the all-reduce itself), and each rank digests its gradients right before the
    optimizer step (a gradient changed after the all-reduce, on this rank)."""
    recheck: int = 0
    """Replay the optimizer update of 1 in ``recheck`` parameters (rotating, per step) from a pre-step
    copy, and compare with the rank's own result: a non-reproducible update is the machine. 0: off;
    1: every parameter at every step, within ``recheck_bytes``."""
    recheck_bytes: int = RECHECK_BYTES
    """The replay's budget per optimizer step, in bytes copied (each covered parameter, its gradient and its
    optimizer state): parameters are taken in turn until it is spent, so over the steps every parameter
    smaller than it is replayed, at a bounded cost per step. A parameter larger than it is never replayed
    (the records say so). 0: no budget (``recheck`` alone decides)."""

    def __post_init__(self) -> None:
        for name, unit in (("recheck", "1 in n parameters"), ("recheck_bytes", "bytes per step")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"attribution {name}={value!r}: must be an integer >= 0 ({unit})")
        if not (self.at_rest or self.collective or self.recheck):
            raise ValueError("attribution: at_rest, collective and recheck are all off; pass attribution=False")

    def fingerprint(self) -> str:
        """Part of the audit position: every rank must watch alike (the records are exchanged)."""
        parts = (["rest"] if self.at_rest else []) + (["collective"] if self.collective else [])
        parts += [f"recheck/{self.recheck}/{self.recheck_bytes}"] if self.recheck else []
        return " attribution=" + ",".join(parts)


def check_attribution(value: Any, argument: str = "attribution") -> AttributionConfig | None:
    """``False``/``None`` (off), ``True`` (at rest, collective, and every update replayed in turn within
    :data:`RECHECK_BYTES` per step), a dict of
    :class:`AttributionConfig`'s fields, or one itself.

    >>> check_attribution({"recheck": 4}).recheck
    4
    """
    if value is None or value is False:
        return None
    if value is True:
        return AttributionConfig(at_rest=True, collective=True, recheck=1)
    if isinstance(value, AttributionConfig):
        return value
    if isinstance(value, dict):
        known = set(AttributionConfig.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"{argument}: unknown field(s) {unknown}; the fields are {sorted(known)}")
        return AttributionConfig(**value)
    raise TypeError(f"{argument}={value!r}: pass True, False, a dict of fields or an AttributionConfig")


@dataclass(frozen=True, slots=True)
class Culprit:
    """Who is wrong, on what evidence, and whose machine is suspect."""

    ranks: tuple[int, ...]
    """The ranks named as holding the wrong values (empty: no rank can be named)."""
    evidence: str
    """What names them: attribution's evidence (``at_rest_change``, ...), ``majority``, or ``none``."""
    machine: tuple[int, ...]
    """The ranks with evidence about their machine: a hardware-suspect blame, or an unstable second read."""
    why: str
    """In words: the evidence that names them, or why no rank can be named."""

    @property
    def by_records(self) -> bool:
        """Named by attribution's per-step records (not by the vote)."""
        return self.evidence not in ("majority", "none")


def strict_majority(mismatches: Sequence[Mismatch]) -> tuple[list[int], str]:
    """The ranks outside a strict majority, when every differing tensor has one; else ``([], why)``.

    >>> strict_majority([Mismatch("w", "param", [1], [0], detail="tie vote: rank 0 vs rank 1, no majority")])
    ([], 'tie vote on w: no majority')
    """
    for m in mismatches:
        if m.tie:
            return [], f"tie vote on {m.name}: no majority"
        if len(m.reference_ranks) <= len(m.ranks):
            held = len(m.reference_ranks)
            return (
                [],
                f"no strict majority on {m.name}: {held} of {held + len(m.ranks)} rank(s) hold its reference value",
            )
    return sorted({r for m in mismatches for r in m.ranks}), ""


def culprit(mismatches: Sequence[Mismatch], blame: Mapping[str, Any] | None) -> Culprit:
    """Who is wrong in a divergence (``mismatches``, with the ``blame`` the same audit decided); pure, so the
    same on every rank."""
    unstable = tuple(sorted({r for m in mismatches if m.stability == "unstable" for r in m.ranks}))
    blame = blame or {}
    named = sorted(set(blame.get("ranks") or []))
    evidence = str(blame.get("evidence") or "")
    if named and evidence != "vote":
        hardware = named if blame.get("hardware_suspect") else []
        why = f"attribution's blame ({evidence}): {blame.get('detail') or ''}".rstrip(": ")
        return Culprit(tuple(named), evidence, tuple(sorted({*hardware, *unstable})), why)
    odd, why = strict_majority(mismatches)
    if odd:
        return Culprit(
            tuple(odd), "majority", unstable, f"a strict majority holds the reference value, {fmt_ranks(odd)} another"
        )
    if not mismatches:
        return Culprit((), "none", unstable, "nothing differs")
    return Culprit((), "none", unstable, f"{why}, and no rank's own per-step record says which side is wrong")


def resync_source(mismatches: Sequence[Mismatch], blame: Mapping[str, Any] | None, src: Any) -> tuple[Any, str | None]:
    """The resync source for a divergence with a tie vote, and what chose it, for the plan's note (``None``:
    no tie, ``src`` as it is).

    The blame, when it names ranks by their records, decides: ``src`` unless it is blamed, else the lowest
    rank involved that is not (never the blamed side over the other). With nothing but the tie, ``src`` is
    kept and the words say it was chosen without evidence. A tensor whose copies differ in holding NaN/inf
    is not counted: its finite copy is the evidence
    (:func:`~weightsync_audit.engine.repair.plan.plan_resync`).

    >>> tie = Mismatch("w", "param", [1], [0], detail="tie vote: rank 0 vs rank 1, no majority")
    >>> resync_source([tie], None, 0)[1]
    "resync_src, chosen without evidence: no rank's own record says which side is wrong"
    >>> resync_source([tie], {"ranks": [0], "evidence": "at_rest_change", "hardware_suspect": True}, 0)
    (1, 'not resync_src: rank 0 blamed by attribution (at_rest_change)')
    """
    if not any(m.tie and m.reference_ranks and m.kind != "structure" and not m.nonfinite for m in mismatches):
        return src, None
    who = culprit(mismatches, blame)
    if not who.by_records:
        chooser = "resync_src" if src != "majority" else "the side holding the lowest rank"
        return src, f"{chooser}, chosen without evidence: no rank's own record says which side is wrong"
    blamed = set(who.ranks)
    involved = sorted({r for m in mismatches for r in (*m.ranks, *m.reference_ranks)})
    if src != "majority" and src in involved and src not in blamed:
        return src, f"resync_src; {fmt_ranks(list(who.ranks))} blamed by attribution ({who.evidence})"
    chosen = next((r for r in involved if r not in blamed), None)
    if chosen is None:
        return src, f"resync_src: every rank involved is blamed by attribution ({who.evidence})"
    return chosen, f"not resync_src: {fmt_ranks(list(who.ranks))} blamed by attribution ({who.evidence})"
