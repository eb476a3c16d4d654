"""Which copies hold NaN or inf: counted on every diverged tensor, and everywhere with ``check_finite``.

Replicas that agree bit for bit can all hold the same NaN (an overflow that hit every rank alike): the
digests agree, the audit is "in sync", and training is ruined all the same. And on a divergence, which
side holds the non-finite value decides which side may be copied over the other (a resync never takes
its source from a NaN where another rank holds a finite value; see
:mod:`~weightsync_audit.engine.repair.resync_plan`).

- :func:`mark_nonfinite` (collective, off the healthy path): each rank counts the NaN/inf elements of
  its own copy of every diverged tensor; the counts are gathered, so every rank writes the same
  ``Mismatch.nonfinite`` (global rank -> elements) and the same words on which side holds what.
- :func:`count_everywhere` (collective, with ``AuditConfig.check_finite``): how many audited tensors hold
  NaN/inf, the largest count over the ranks, and the names (the first rank's).

Counting reads each tensor once (a sum screens it; only a tensor whose sum is not finite is counted
element by element, in bounded pieces): nothing is allocated in proportion to a large tensor.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Sequence

import numpy as np
import torch

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest
from weightsync_audit.engine.hashing.hostbytes import chunk_views
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import brief_names, fmt_ranks

__all__ = [
    "count_everywhere",
    "count_nonfinite",
    "apply_nonfinite",
    "mark_nonfinite",
    "nonfinite_row",
    "nonfinite_entries",
    "nonfinite_indices",
]

_PIECE = 1 << 18
"""Elements per piece of an exact count (the bool temporary stays at most this large)."""
_SMALL = 1 << 14
"""Elements under which tensors are screened together, one concatenation per dtype and device."""
_UNKNOWN = -1
_DTYPE = torch.Tensor.dtype.__get__  # type: ignore[attr-defined]


def _floating(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _all_finite(t: torch.Tensor) -> bool:
    # A finite sum proves every element finite (NaN and inf propagate); an overflow sends it to the count.
    return bool(torch.isfinite(t.sum())) or count_nonfinite(t) == 0


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN and ±inf elements of ``t`` (0 for integer, bool and empty tensors).

    >>> import torch
    >>> count_nonfinite(torch.tensor([1.0, float("nan"), float("-inf")]))
    2
    """
    t = t.detach()
    if not _floating(t) or t.numel() == 0:
        return 0
    if bool(torch.isfinite(t.sum())):
        return 0
    return sum(int(torch.isfinite(piece).logical_not_().sum()) for piece in chunk_views(t, _PIECE))


def nonfinite_indices(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Positions of the tensors holding NaN or inf; small ones are screened together per dtype."""
    out: list[int] = []
    small: dict[tuple[torch.dtype, bool], list[int]] = {}
    for i, (t, dtype) in enumerate(zip(tensors, map(_DTYPE, tensors))):
        if not (dtype.is_floating_point or dtype.is_complex):
            continue
        n = t.numel()
        if 0 < n <= _SMALL:
            small.setdefault((dtype, t.is_cpu), []).append(i)
        elif n and not _all_finite(t.detach()):
            out.append(i)
    for idx in small.values():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        if not bool(torch.isfinite(flat.sum())):  # a finite sum: no NaN/inf (an overflow is checked below)
            out.extend(i for i in idx if count_nonfinite(tensors[i]))
    return sorted(out)


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


def mark_nonfinite(comm: Comm, mismatches: Sequence[Mismatch], entries: Sequence[Any]) -> None:
    """Collective: ``m.nonfinite`` and a detail note for every diverged tensor (``entries`` aligned).

    Called by every rank with the same mismatches (the localized record), ranks still positions in
    the group; the counts are written by global rank.
    """
    if not mismatches:
        return
    table = comm.exchange(nonfinite_row(entries), "the non-finite counts", compact=True)
    apply_nonfinite(comm.global_ranks, mismatches, table)


def nonfinite_row(entries: Sequence[Any]) -> np.ndarray:
    """This rank's count of NaN/inf elements in each of ``entries``' tensors (for :func:`apply_nonfinite`)."""
    return np.array([_safe_count(e.tensor) for e in entries], dtype=np.int64)


def apply_nonfinite(g: Sequence[int], mismatches: Sequence[Mismatch], table: np.ndarray) -> None:
    """:func:`mark_nonfinite` from the gathered ``[world, n]`` counts (``g``: the group's global ranks);
    the same on every rank."""
    for j, m in enumerate(mismatches):
        counts = {g[r]: int(table[r, j]) for r in range(table.shape[0]) if table[r, j] > 0}
        m.nonfinite = counts or None
        if counts:
            local = Mismatch(m.name, m.kind, [g[r] for r in m.ranks], [g[r] for r in m.reference_ranks])
            local.nonfinite = counts
            text = side_text(local)
            m.detail = f"{text}; {m.detail}" if m.detail else text


def _bad_views(views: list[Any], dtype: torch.dtype) -> list[int]:
    """Which of ``views`` (raw memory of tensors of ``dtype``) hold NaN/inf: one pass over them all."""
    # A finite sum proves every element finite (NaN and inf propagate); only an overflow or a real NaN/inf
    # sends the views to the element-wise check.
    if bool(torch.isfinite(torch.frombuffer(bytearray().join(views), dtype=dtype).sum())):
        return []
    return [
        k for k, v in enumerate(views) if not bool(torch.isfinite(torch.frombuffer(bytearray(v), dtype=dtype)).all())
    ]


def nonfinite_entries(prepared: PreparedManifest) -> list[int]:
    """Entry indices of a prepared manifest whose tensors hold NaN/inf.

    On a cached plan the tensors hashed in place are read through the plan's wrappers, all of one dtype
    in one pass (checked by :meth:`DigestPlan.verify` in this same audit, like the hashing); the others
    one by one.
    """
    plan = prepared.plan
    found: list[int] = []
    if plan.fast_count:
        for dtype, (views, where) in plan.floating.items():
            found += [where[k] for k in _bad_views(views, dtype)]
        slow = list(itertools.compress(prepared.sources, prepared.slow_mask))
        found += [int(plan.slow_index[k]) for k in nonfinite_indices(slow)]
    else:
        found += [int(plan.all_index[k]) for k in nonfinite_indices(prepared.sources)]
    found += [int(plan.dyn_index[k]) for k in nonfinite_indices(prepared.dynamic)]
    return sorted(found)


def count_everywhere(comm: Comm, prepared: PreparedManifest) -> tuple[int, list[str]]:
    """Collective: how many audited tensors hold NaN/inf (the most on any rank) and their names.

    Every rank returns the same answer: the counts are exchanged, the names are the first rank's that
    found the most (its manifest is built only then).
    """
    try:
        found = nonfinite_entries(prepared)
    except Exception:  # noqa: BLE001 - never a hang: an unreadable tensor is reported by the audit itself
        found = []
    table = comm.exchange(np.array([len(found)], dtype=np.int64), "the non-finite check")
    most = int(table[:, 0].max())
    if most == 0:
        return 0, []
    first = int(np.nonzero(table[:, 0] == most)[0][0])
    names = [prepared.manifest.entries[i].name for i in found[:5]] if comm.rank == first else []
    mine = json.dumps(names).encode()
    listed = json.loads(comm.share_bytes(first, mine, "the non-finite names"))
    return most, listed


def in_sync_note(count: int, names: Sequence[str]) -> str:
    """The plain words of an in-sync record whose replicas hold NaN/inf."""
    return f"in sync, but {count} tensor(s) hold NaN/inf ({brief_names(names)}): every rank agrees on non-finite values"
