"""Who is wrong: one pure function of the vote's majority and the current blame, :func:`culprit`.

Everything that names a rank as the wrong one reads it here, so that a record never blames one rank while
its repair copies from it or its evict file names the other: the resync source on a tie
(:func:`resync_source`, for :mod:`~weightsync_audit.engine.respond`), the blame by vote
(:func:`~weightsync_audit.engine.attribution.blame.vote_blame`), the machines handed on for eviction
(:mod:`~weightsync_audit.integrations.evict`) and the "machine" wording of the hints
(:func:`persistent_hints`). The rules, in order:

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

Transient or persistent (:func:`reread_row`, :func:`apply_stability`): on a divergence, the odd ranks read each
diverged tensor a second time.

A digest that changes between the audit's read and this one, with no optimizer step between them, means
the bytes in memory are not holding still: an *unstable* read, which points at memory or hardware (or a
thread writing the weights behind the training loop's back), not at a software bug that replicas share.
Each rank re-reads only the tensors it holds the odd value of; its flags ride the gap layouts' round
(:mod:`~weightsync_audit.engine.measure.remote_gaps`), so every rank sets the same ``Mismatch.stability``
from the same gathered table.

>>> from weightsync_audit.reporting.record import Mismatch
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

import numpy as np

from weightsync_audit.engine.agreement.consensus import ValueDiff
from weightsync_audit.engine.hashing.digest import digest_entries
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import fmt_ranks

__all__ = [
    "Culprit",
    "apply_stability",
    "culprit",
    "persistent_hints",
    "reread_row",
    "resync_source",
    "strict_majority",
    "unstable_hints",
]


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


def reread_row(
    rank: int,
    diffs: Sequence[ValueDiff],
    entries: Sequence[Entry],
    first: np.ndarray,
    *,
    slice_index: int,
    slices: int,
    method: str,
) -> np.ndarray:
    """This rank's second read: 1 for each of ``diffs`` whose odd copy it holds and whose digest changed
    since ``first`` (the audit's digests of ``entries``), else 0 (for :func:`apply_stability`)."""
    index = {e.uid: i for i, e in enumerate(entries)}
    mine = [i for i, d in enumerate(diffs) if rank in d.ranks and d.uid in index]
    flags = np.zeros(len(diffs), dtype=np.int64)
    if mine:
        again = digest_entries(
            [entries[index[diffs[i].uid]] for i in mine], slice_index=slice_index, slices=slices, method=method
        )
        for i, d in zip(mine, again.tolist()):
            flags[i] = int(int(first[index[diffs[i].uid]]) != int(d))
    return flags


def apply_stability(mismatches: Sequence[Mismatch], table: np.ndarray) -> None:
    """``stability`` on each mismatch from the gathered ``[world, n]`` flags of :func:`reread_row`: unstable
    where any rank's second read changed."""
    for i, m in enumerate(mismatches):
        m.stability = "unstable" if bool(table[:, i].any()) else "stable"


def unstable_hints(mismatches: Sequence[Mismatch], hosts: dict[str, str] | None) -> list[str]:
    """One hint naming the ranks (and where they run) whose second read gave other bytes."""
    shaky = [m for m in mismatches if m.stability == "unstable"]
    if not shaky:
        return []
    ranks = sorted({r for m in shaky for r in m.ranks})
    where = "; ".join(f"rank {r} on {(hosts or {}).get(str(r), 'an unknown host')}" for r in ranks)
    names = ", ".join(m.name for m in shaky[:5])
    return [
        f"{names}: a second read on the odd rank(s) gave other bytes with no step between the reads (an unstable "
        f"read): suspect memory or hardware, not a software bug ({where}); if it recurs, evict that machine"
    ]


def persistent_hints(
    mismatches: Sequence[Mismatch],
    blame: Mapping[str, Any] | None,
    resynced: dict[int, int],
    hosts: dict[str, str] | None,
) -> list[str]:
    """Hints for a divergence that came back after a resync (``resynced``: each rank a resync repaired -> the
    step). The ranks are named by the one rule (:func:`~weightsync_audit.engine.culprit.culprit`), and a
    machine only on evidence about it (a hardware-suspect blame, an unstable read): a persistent fault on
    that machine, to evict; otherwise the cause persists (code, settings or data) and no machine is named."""
    live = [m for m in mismatches if not m.within_tolerance]
    who = culprit(live, blame)
    involved = {r for m in live for r in (*m.ranks, *m.reference_ranks)}
    again = sorted(set(who.ranks or involved) & set(resynced))
    if not again:
        return []
    where = lambda r: (hosts or {}).get(str(r), "host unknown")  # noqa: E731
    out = [
        f"rank {r} diverged again after a resync repaired it at step {resynced[r]}: a persistent fault on that "
        f"machine ({where(r)}; {who.why}); evict it and restart from the last verified checkpoint"
        for r in again
        if r in who.machine
    ]
    soft = [r for r in again if r not in who.machine]
    step = max(resynced[r] for r in again)
    if soft and who.ranks:
        out.append(
            f"{fmt_ranks(soft)} diverged again after a resync repaired {'it' if len(soft) == 1 else 'them'} at step "
            f"{step}: the cause persists and resync only hides it ({who.why}). Nothing says it is the machine: look "
            "for code, settings or data that differ on that rank (a learning rate, a seed, a hook); another machine "
            "would not fix it"
        )
    elif soft:
        out.append(
            f"the replicas diverged again after a resync at step {step}: the cause persists and resync only hides "
            f"it. No rank can be named ({who.why}), so no machine is named to evict; attribution=True records each "
            "rank's own steps and can tell which side changes"
        )
    return out
