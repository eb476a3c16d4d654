"""Which copies hold NaN or inf: counted on every diverged tensor, and everywhere with ``check_finite``.

Replicas that agree bit for bit can all hold the same NaN (an overflow that hit every rank alike): the
digests agree, the audit is "in sync", and training is ruined all the same. And on a divergence, which
side holds the non-finite value decides which side may be copied over the other (a resync never takes
its source from a NaN where another rank holds a finite value; see
:mod:`~weightsync_audit.engine.repair.plan`).

- :func:`nonfinite_row` then :func:`apply_nonfinite` (off the healthy path): each rank counts the NaN/inf
  elements of its own copy of every diverged tensor; the counts ride the gaps' round, so every rank writes
  the same ``Mismatch.nonfinite`` (global rank -> elements) and the same words on which side holds what.
- :func:`count_everywhere` (collective, with ``AuditConfig.check_finite``): how many audited tensors hold
  NaN/inf, the largest count over the ranks, and the names (the first rank's).

Counting reads each tensor once (a sum screens it; only a tensor whose sum is not finite is counted
element by element, in bounded pieces): nothing is allocated in proportion to a large tensor.

Transient or persistent (:func:`reread_row`, :func:`apply_stability`): on a divergence, the odd ranks read each
diverged tensor a second time.

A digest that changes between the audit's read and this one, with no optimizer step between them, means
the bytes in memory are not holding still: an *unstable* read, which points at memory or hardware (or a
thread writing the weights behind the training loop's back), not at a software bug that replicas share.
Each rank re-reads only the tensors it holds the odd value of; its flags ride the gap layouts' round
(:mod:`~weightsync_audit.engine.measure.remote_gaps`), so every rank sets the same ``Mismatch.stability``
from the same gathered table.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.agreement.consensus import ValueDiff
from weightsync_audit.engine.attribution import culprit
from weightsync_audit.engine.hashing.digest import digest_entries
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest
from weightsync_audit.engine.hashing.reader import chunk_views
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import brief_names, fmt_ranks

__all__ = [
    "apply_stability",
    "persistent_hints",
    "reread_row",
    "unstable_hints",
    "NonfiniteCount",
    "count_everywhere",
    "count_nonfinite",
    "apply_nonfinite",
    "nonfinite_row",
    "screen_entries",
    "screen_nonfinite",
]

_PIECE = 1 << 18
"""Elements per piece of an exact count (the bool temporary stays at most this large)."""
_SMALL = 1 << 14
"""Elements under which tensors are screened together, one concatenation per dtype and device."""
_UNKNOWN = -1
_DTYPE = torch.Tensor.dtype.__get__  # type: ignore[attr-defined]


def _floating(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


_SUMMED = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128})
"""Dtypes screened by a sum as they are; every other floating dtype (float8, complex32) has no sum or
``isfinite`` kernel on some device and is counted in pieces widened to float32 / complex64 (exact: the
widening keeps every NaN and inf)."""
_NO_NONFINITE = frozenset(d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None)
"""Floating dtypes that have no NaN or inf encoding at all (nothing to count, nothing to read)."""


def _wide(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a piece of ``dtype`` is counted in; ``None`` for a dtype summed as it is."""
    if dtype in _SUMMED:
        return None
    return torch.complex64 if dtype.is_complex else torch.float32


def _all_finite(t: torch.Tensor) -> bool:
    # A finite sum proves every element finite (NaN and inf propagate); an overflow sends it to the count.
    if _wide(t.dtype) is not None:
        return count_nonfinite(t) == 0
    return bool(torch.isfinite(t.sum())) or count_nonfinite(t) == 0


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN and ±inf elements of ``t`` (0 for integer, bool and empty tensors).

    Any floating dtype is counted: float8 and complex32, which have no sum on the CPU, in pieces widened
    to float32 / complex64 (a piece at a time, never the whole tensor). Raises where the tensor cannot be
    read at all (the caller names it as not counted).

    >>> import torch
    >>> count_nonfinite(torch.tensor([1.0, float("nan"), float("-inf")]))
    2
    >>> count_nonfinite(torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn))
    1
    """
    t = t.detach()
    if not _floating(t) or t.numel() == 0 or t.dtype in _NO_NONFINITE:
        return 0
    wide = _wide(t.dtype)
    if wide is not None:
        return sum(int(torch.isfinite(piece.to(wide)).logical_not_().sum()) for piece in chunk_views(t, _PIECE))
    if bool(torch.isfinite(t.sum())):
        return 0
    return sum(int(torch.isfinite(piece).logical_not_().sum()) for piece in chunk_views(t, _PIECE))


def screen_nonfinite(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Positions of the tensors holding NaN or inf, and of those that could not be read to tell.

    Small tensors of a dtype summed as it is are screened together per dtype and device; a tensor that
    cannot be counted (a dtype with no kernel to read it on its device) is listed apart and never hides
    the others' counts.
    """
    out: list[int] = []
    uncounted: list[int] = []
    small: dict[tuple[torch.dtype, bool], list[int]] = {}
    for i, (t, dtype) in enumerate(zip(tensors, map(_DTYPE, tensors))):
        if not (dtype.is_floating_point or dtype.is_complex):
            continue
        n = t.numel()
        if 0 < n <= _SMALL and _wide(dtype) is None:
            small.setdefault((dtype, t.is_cpu), []).append(i)
        elif n:
            _screen_one(t.detach(), i, out, uncounted)
    for idx in small.values():
        try:
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
            clean = bool(torch.isfinite(flat.sum()))  # a finite sum: no NaN/inf (an overflow is checked below)
        except Exception:  # noqa: BLE001 - screened one by one instead
            clean = False
        if not clean:
            for i in idx:
                _screen_one(tensors[i].detach(), i, out, uncounted)
    return sorted(out), sorted(uncounted)


def _screen_one(t: torch.Tensor, i: int, out: list[int], uncounted: list[int]) -> None:
    try:
        bad = not _all_finite(t)
    except Exception:  # noqa: BLE001 - named as not counted, never a hang and never a silent 0
        uncounted.append(i)
        return
    if bad:
        out.append(i)


def _safe_count(t: torch.Tensor) -> int:
    # Nothing here may raise on one rank alone (the others would wait in the exchange).
    try:
        return count_nonfinite(t)
    except Exception:  # noqa: BLE001 - an odd tensor is "unknown", never a hang
        return _UNKNOWN


def side_text(m: Mismatch) -> str | None:
    """Which side of a mismatch holds NaN/inf, in words; ``None`` when no copy does."""
    bad = m.nonfinite or {}
    if not bad:
        return None
    ref_bad = [r for r in m.reference_ranks if r in bad]
    odd_bad = [r for r in m.ranks if r in bad]
    held = ", ".join(f"rank {r}: {n}" for r, n in sorted(bad.items()))
    if ref_bad and not odd_bad:
        return (
            f"NaN or inf in the reference copy ({fmt_ranks(ref_bad)}; elements {held}); "
            f"{fmt_ranks(m.ranks)} hold{'s' if len(m.ranks) == 1 else ''} finite values"
        )
    if odd_bad and not ref_bad:
        return f"NaN or inf on {fmt_ranks(odd_bad)} (elements {held}); the reference copy ({fmt_ranks(m.reference_ranks)}) is finite"
    return f"NaN or inf on both sides (elements {held})"


def nonfinite_row(entries: Sequence[Any]) -> np.ndarray:
    """This rank's count of NaN/inf elements in each of ``entries``' tensors (for :func:`apply_nonfinite`)."""
    return np.array([_safe_count(e.tensor) for e in entries], dtype=np.int64)


def apply_nonfinite(g: Sequence[int], mismatches: Sequence[Mismatch], table: np.ndarray) -> None:
    """``m.nonfinite`` and a detail note for every diverged tensor, from the gathered ``[world, n]`` counts of
    :func:`nonfinite_row` (``g``: the group's global ranks); the same on every rank."""
    for j, m in enumerate(mismatches):
        counts = {g[r]: int(table[r, j]) for r in range(table.shape[0]) if table[r, j] > 0}
        m.nonfinite = counts or None
        if counts:
            local = Mismatch(m.name, m.kind, [g[r] for r in m.ranks], [g[r] for r in m.reference_ranks])
            local.nonfinite = counts
            text = side_text(local)
            m.detail = f"{text}; {m.detail}" if m.detail else text


def _bad_views(views: list[Any], dtype: torch.dtype) -> tuple[list[int], list[int]]:
    """Which of ``views`` (raw memory of tensors of ``dtype``) hold NaN/inf, and which could not be read:
    one pass over them all for a dtype summed as it is."""
    # A finite sum proves every element finite (NaN and inf propagate); only an overflow or a real NaN/inf
    # sends the views to the element-wise check.
    if _wide(dtype) is None:
        try:
            if bool(torch.isfinite(torch.frombuffer(bytearray().join(views), dtype=dtype).sum())):
                return [], []
        except Exception:  # noqa: BLE001 - counted one by one below
            pass
    bad: list[int] = []
    uncounted: list[int] = []
    for k, v in enumerate(views):
        if len(v):
            _screen_one(torch.frombuffer(bytearray(v), dtype=dtype), k, bad, uncounted)
    return bad, uncounted


def screen_entries(prepared: PreparedManifest) -> tuple[list[int], list[int]]:
    """Entry indices of a prepared manifest whose tensors hold NaN/inf, and of those not counted.

    On a cached plan the tensors hashed in place are read through the plan's wrappers, all of one dtype
    in one pass (checked by :meth:`DigestPlan.verify` in this same audit, like the hashing); the others
    one by one.
    """
    plan = prepared.plan
    found: list[int] = []
    uncounted: list[int] = []

    def add(at: Any, screened: tuple[list[int], list[int]]) -> None:
        found.extend(int(at[k]) for k in screened[0])
        uncounted.extend(int(at[k]) for k in screened[1])

    if plan.fast_count:
        for dtype, (views, where) in plan.floating.items():
            add(where, _bad_views(views, dtype))
        add(plan.slow_index, screen_nonfinite(list(itertools.compress(prepared.sources, prepared.slow_mask))))
    else:
        add(plan.all_index, screen_nonfinite(prepared.sources))
    add(plan.dyn_index, screen_nonfinite(prepared.dynamic))
    return sorted(found), sorted(uncounted)


class NonfiniteCount(NamedTuple):
    """What :func:`count_everywhere` found, the same on every rank."""

    count: int
    """Audited tensors holding NaN/inf: the most on any rank."""
    names: list[str]
    """Up to five of them (the first rank's that found the most)."""
    uncounted: int = 0
    """Floating tensors that could not be read to tell (the most on any rank): not in ``count``."""
    uncounted_names: list[str] = []
    """Up to five of them, each with its dtype and device (the first rank's that had the most)."""
    failed_ranks: list[int] = []
    """Global ranks on which the check itself failed (their tensors are not in ``count``)."""

    def notes(self, in_sync: bool) -> list[str]:
        """The record's words: what holds NaN/inf, and what could not be counted (never a silent 0)."""
        out: list[str] = []
        if self.count:
            out.append(
                in_sync_note(self.count, self.names)
                if in_sync
                else f"{self.count} tensor(s) hold NaN/inf on some rank: {', '.join(self.names)}"
            )
        if self.uncounted:
            out.append(
                f"NaN/inf not counted in {self.uncounted} tensor(s) ({', '.join(self.uncounted_names)}"
                f"{', ...' if self.uncounted > len(self.uncounted_names) else ''}): their dtype cannot be read on "
                "their device; nonfinite_count covers the other tensors"
            )
        if self.failed_ranks:
            out.append(
                f"the NaN/inf check failed on {fmt_ranks(self.failed_ranks)}: nonfinite_count covers the other ranks"
            )
        return out


def _described(prepared: PreparedManifest, i: int) -> str:
    e = prepared.manifest.entries[i]
    t = getattr(e, "tensor", None)
    where = f" {str(t.dtype).removeprefix('torch.')} on {t.device}" if isinstance(t, torch.Tensor) else ""
    return f"{e.name}{where}"


def count_everywhere(comm: Comm, prepared: PreparedManifest) -> NonfiniteCount:
    """Collective: how many audited tensors hold NaN/inf (the most on any rank) and their names, and the
    floating tensors that could not be read to tell (named, never folded into a silent 0).

    Every rank returns the same answer: the counts are exchanged in one round with each rank's names; the
    coordinator picks the first rank that found the most of each.
    """
    failed = 0
    try:
        found, uncounted = screen_entries(prepared)
    except Exception:  # noqa: BLE001 - never a hang: this rank's failure is named in the record
        found, uncounted, failed = [], [], 1
    names = [prepared.manifest.entries[i].name for i in found[:5]] if found else []
    odd = [_described(prepared, i) for i in uncounted[:5]] if uncounted else []
    row = np.array([len(found), len(uncounted), failed], dtype=np.int64)

    def pick(table: np.ndarray, blobs: list[bytes]) -> bytes:
        out: list[list[str]] = [[], []]
        for col in (0, 1):
            first = int(np.argmax(table[:, col]))  # the first rank holding the most
            try:
                out[col] = [str(n) for n in json.loads(blobs[first])[col]] if table[first, col] else []
            except Exception:  # noqa: BLE001 - run on the coordinator alone: never raise there
                out[col] = ["(names unreadable)"]
        return json.dumps(out).encode()

    table, answer = comm.exchange_then(row, "the non-finite check", blob=json.dumps([names, odd]).encode(), then=pick)
    listed, odd_listed = json.loads(answer)
    g = comm.global_ranks
    return NonfiniteCount(
        count=int(table[:, 0].max()),
        names=listed,
        uncounted=int(table[:, 1].max()),
        uncounted_names=odd_listed,
        failed_ranks=[g[r] for r in np.nonzero(table[:, 2])[0].tolist()],
    )


def in_sync_note(count: int, names: Sequence[str]) -> str:
    """The plain words of an in-sync record whose replicas hold NaN/inf."""
    return f"in sync, but {count} tensor(s) hold NaN/inf ({brief_names(names)}): every rank agrees on non-finite values"


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
    step). The ranks are named by the one rule (:func:`~weightsync_audit.engine.attribution.culprit`), and a
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
