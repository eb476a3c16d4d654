"""Each diverged tensor dated to its own first step: :class:`TensorRing` and :func:`date_tensors`.

The pinpoint ring keeps one digest per step, over everything audited: it dates the *first* difference of
all. A bug planted at step 12 among a tensor drifting since step 3 would read as step 3 for both. So each
rank also keeps, per recorded step, the digest vector of every audited tensor (the one the step's digest
is folded from: no extra hashing), in a ring bounded by bytes (:data:`TENSOR_RING_BYTES`; the oldest
steps go first). When an audit finds a divergence, every rank sends the columns of the diverged tensors
only, and the coordinator dates each one, exactly as the pinpoint ring is read: the first step whose
digests differ, or that some rank did not record; ``exact`` only when a step before it agreed (or an
in-sync audit vouches for the step before the first one kept). A tensor it cannot date so is left
undated (the mismatch's ``first_diverged_step`` is null).

>>> a, b = TensorRing(1 << 20), TensorRing(1 << 20)
>>> for step, x, y in [(1, [10, 20], [10, 20]), (2, [11, 21], [12, 21]), (3, [13, 22], [14, 23])]:
...     a.record(step, np.array(x, np.int64), 7)
...     b.record(step, np.array(y, np.int64), 7)
>>> uids = ["param:w", "param:b"]
>>> dates_from([a.columns([0, 1], None), b.columns([0, 1], None)], uids)
{'param:w': 2, 'param:b': 3}
"""

from __future__ import annotations

import json
from collections import deque
from typing import Sequence

import numpy as np

from weightsync_audit.channel.star import Comm

__all__ = ["MAX_DATED", "TENSOR_RING_BYTES", "TensorRing", "date_tensors", "dates_from"]

TENSOR_RING_BYTES = 32 << 20
"""Per-tensor digests a rank keeps at most (8 bytes per tensor per step): 32 MiB."""
MAX_DATED = 256
"""Diverged tensors dated at most per audit (the first ones in the record's order)."""
_NONE = -(1 << 63)


class TensorRing:
    """This rank's per-step digest vectors (one 64-bit word per audited tensor) since the last in-sync audit."""

    def __init__(self, budget: int = TENSOR_RING_BYTES) -> None:
        self.budget = budget
        self.steps: deque[int] = deque()
        self.vectors: deque[np.ndarray] = deque()
        self.structure: int | None = None
        self.dropped = 0
        """Steps lost since the last in-sync audit (the budget, or a change of the audited set)."""

    def record(self, step: int, digests: np.ndarray, structure: int) -> None:
        """The digests of every audited tensor after optimizer ``step`` (the same step again replaces it)."""
        if structure != self.structure:  # another audited set: its columns do not line up with the kept ones
            self.dropped += len(self.steps)
            self.steps.clear()
            self.vectors.clear()
            self.structure = structure
        if self.steps and self.steps[-1] == step:
            self.vectors[-1] = digests.copy()
            return
        self.steps.append(int(step))
        self.vectors.append(digests.copy())
        while len(self.steps) > 1 and len(self.steps) * digests.nbytes > self.budget:
            self.steps.popleft()
            self.vectors.popleft()
            self.dropped += 1

    def trim(self, step: int) -> None:
        """An in-sync audit at ``step`` vouches for it: what came before is forgotten."""
        while self.steps and self.steps[0] < step:
            self.steps.popleft()
            self.vectors.popleft()
        self.dropped = 0

    def restart(self) -> None:
        """Every rank was made to hold the same values (a resync), or the set dated changed: start afresh."""
        self.steps.clear()
        self.vectors.clear()
        self.dropped = 0

    def columns(self, positions: Sequence[int], anchor: int | None) -> bytes:
        """The kept steps and, for each of ``positions`` (manifest order; -1: not held here), its digest per step."""
        n = len(self.steps)
        size = len(self.vectors[0]) if n else 0
        matrix = np.full((n, len(positions)), _NONE, dtype=np.int64)
        for j, pos in enumerate(positions):
            if 0 <= pos < size:
                matrix[:, j] = [v[pos] for v in self.vectors]
        head = [self.dropped, _NONE if anchor is None else anchor, n, len(positions)]
        return np.concatenate([np.array(head + list(self.steps), np.int64), matrix.reshape(-1)]).tobytes()


def _decode(blob: bytes) -> tuple[int, int | None, list[int], np.ndarray]:
    a = np.frombuffer(blob, dtype=np.int64)
    dropped, anchor, n, m = (int(x) for x in a[:4])
    steps = a[4 : 4 + n].tolist()
    return dropped, None if anchor == _NONE else anchor, steps, a[4 + n : 4 + n + n * m].reshape(n, m)


def dates_from(blobs: Sequence[bytes], uids: Sequence[str]) -> dict[str, int]:
    """From every rank's :meth:`TensorRing.columns` (rank order): each tensor's first diverged step, where exact."""
    decoded = [_decode(b) for b in blobs]
    anchors = {d[1] for d in decoded}
    anchor = anchors.pop() if len(anchors) == 1 else None
    dropped = any(d[0] for d in decoded)
    by_step = [dict(zip(d[2], range(len(d[2])))) for d in decoded]
    steps = sorted(set().union(*(d[2] for d in decoded)))
    if dropped:  # steps before the latest start of a ring that lost some are not compared
        start = max((d[2][0] for d in decoded if d[2]), default=None)
        steps = [s for s in steps if start is None or s >= start]
    out: dict[str, int] = {}
    for j, uid in enumerate(uids):
        first = None
        for i, s in enumerate(steps):
            cells = [d[3][at[s], j] if s in at else None for d, at in zip(decoded, by_step)]
            if _NONE in cells:
                break  # a rank does not hold this tensor: not dated
            if None in cells or len(set(cells)) > 1:
                first = i
                break
        if first is None:
            continue
        s = steps[first]
        if first > 0 or (not dropped and anchor is not None and anchor < s):
            out[uid] = s
    return out


def date_tensors(
    comm: Comm, ring: TensorRing, positions: Sequence[int], uids: Sequence[str], anchor: int | None
) -> dict[str, int]:
    """Collective, on a divergence: every rank sends the columns of the diverged tensors (``positions`` in its
    manifest, ``uids`` the same on every rank); the coordinator dates them; every rank gets the same dates."""

    def rule(parts: list[bytes]) -> bytes:
        try:
            return json.dumps(dates_from(parts, uids)).encode()
        except Exception:  # noqa: BLE001 - undated, never a failed audit
            return b"{}"

    return {
        str(k): int(v)
        for k, v in json.loads(comm.decide(ring.columns(positions, anchor), rule, "the tensor dates")).items()
    }
