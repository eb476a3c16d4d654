"""Transient or persistent: on a divergence, the odd ranks read each diverged tensor a second time.

A digest that changes between the audit's read and this one, with no optimizer step between them, means
the bytes in memory are not holding still: an *unstable* read, which points at memory or hardware (or a
thread writing the weights behind the training loop's back), not at a software bug that replicas share.
Each rank re-reads only the tensors it holds the odd value of; its flags ride the gap layouts' round
(:mod:`~weightsync_audit.engine.measure.remote_gaps`), so every rank sets the same ``Mismatch.stability``
from the same gathered table.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from weightsync_audit.engine.agreement.consensus import ValueDiff
from weightsync_audit.engine.culprit import culprit
from weightsync_audit.engine.hashing.digest import digest_entries
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import fmt_ranks

__all__ = ["apply_stability", "persistent_hints", "reread_row", "unstable_hints"]


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
