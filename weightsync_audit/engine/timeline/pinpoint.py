"""Pinpoint: the exact step at which replicas parted, even when no audit ran at that step.

At every optimizer step each rank digests, locally and without any communication, what the audit
covers (one 64-bit digest over every audited tensor, from the audit's own manifest and digests) and keeps ``(step, digest)``
in a bounded :class:`StepRing`. An in-sync audit trims the ring: what came before it is known good.
When an audit finds a divergence, the ranks exchange their rings (one message each, through the
audit's channel) and :func:`locate` finds, from the same gathered rings on every rank, the first step
whose digests disagree: ``first_diverged_step``; the step before it, where they still agreed, is the
exact ``last_in_sync_step``.

A step that some rank did not record while the others did (a skipped optimizer step) is a difference
at that step: it is the first diverged one, and the note names the ranks that lack it; ``exact`` means
every rank held the same steps, agreeing, up to that step.

Only what every rank holds whole feeds the per-step digests: a tensor an engine holds in pieces or on
some ranks only (an FSDP1 or ZeRO shard, a DTensor's local shard, an FSDP1 hybrid shard, the scalar
state of a sharded parameter) differs between ranks by design, or is absent on some, so it is left out of
them. When a divergence lies in such a tensor, the rings cannot date it: the result is ``unavailable``,
naming the tensors and why.

Never a guess: a step counts as in sync only when its full digests agreed (or an in-sync full audit
vouches for it). When the ring lost the steps that would tell (``overflow``), when every recorded step
agreed (``unseen``: the change came after the last recorded step, e.g. outside an optimizer step), or
with sampled per-step digests (``sampled``: the divergence showed at that step and may have begun
earlier), or when the very first recorded step already differed with nothing before it known good
(``earlier``), the result says so and leaves ``first_diverged_step`` null.

>>> ring = StepRing(capacity=8)
>>> for step, d in [(1, 10), (2, 20), (3, 30)]:
...     ring.record_digest(step, d)
>>> other = StepRing(capacity=8)
>>> for step, d in [(1, 10), (2, 21), (3, 31)]:
...     other.record_digest(step, d)
>>> p = locate([ring.encode(), other.encode()])
>>> p.state, p.first_diverged_step, p.last_in_sync_step
('exact', 2, 1)
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.config import check_count
from weightsync_audit.engine.hashing.digest import overall_digest, structure_digest
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest
from weightsync_audit.engine.inventory.manifest import KINDS
from weightsync_audit.engine.timeline.answer import (
    MAX_DATED,
    NO_STEP,
    Pinpoint,
    TensorRing,
    date_tensors,
    locate,
    transient_from,
    with_drift,
)
from weightsync_audit.reporting.record import AuditResult
from weightsync_audit.text import brief_names

__all__ = [
    "DEFAULT_RING",
    "Pinpoint",
    "Pinpointer",
    "StepRing",
    "mark_pinpoint",
]


DEFAULT_RING = 1024
"""Steps a ring holds by default: 16 bytes each (16 KiB); enough for an audit every 1,000 steps."""


class StepRing:
    """This rank's ``(step, digest)`` per optimizer step since the last in-sync audit, at most ``capacity``.

    ``anchor``: the step of the last in-sync full audit (every rank held the same values then).
    ``dropped``: entries pushed out since then because the ring was full.
    """

    def __init__(self, capacity: int = DEFAULT_RING, slices: int = 1) -> None:
        self.capacity = check_count(capacity, "pinpoint_ring", 1, "steps kept between audits")
        self.slices = slices
        self.entries: deque[tuple[int, int]] = deque()
        self.dropped = 0
        self.anchor: int | None = None
        self.trace = 0
        """Every ``(step, digest)`` recorded since the last audit, folded into one word (overflow or not)."""
        self.recorded = 0
        """Steps recorded since the last audit (in sync or not): what a transient divergence may name."""
        self._trace_before = 0  # the trace before the last step, for a step recorded again

    def __len__(self) -> int:
        return len(self.entries)

    def record_digest(self, step: int, digest: int) -> None:
        """Remember ``digest`` for ``step``; the same step again (gradient accumulation) replaces it."""
        step = int(step)
        if self.entries and self.entries[-1][0] == step:
            self.entries[-1] = (step, int(digest))
            self.trace = _fold(self._trace_before, step, int(digest))
            self.recorded = max(self.recorded, 1)
            return
        self._trace_before = self.trace
        self.recorded += 1
        self.trace = _fold(self.trace, step, int(digest))
        self.entries.append((step, int(digest)))
        if len(self.entries) > self.capacity:
            self.entries.popleft()
            self.dropped += 1

    def mark_in_sync(self, step: int | None, *, proven: bool = True) -> None:
        """An audit at ``step`` found every rank in sync: forget what came before it.

        ``proven=False`` (a sampled audit, which saw only part of the values) keeps the ring as it is.
        The trace starts afresh either way: the audit compared it.
        """
        self.audited()
        if step is None or not proven:
            return
        step = int(step)
        while self.entries and self.entries[0][0] < step:
            self.entries.popleft()
        self.dropped = 0
        self.anchor = step

    def restart(self, step: int | None) -> None:
        """Every rank was made to hold the same values at ``step`` (a resync): nothing recorded before counts."""
        self.entries.clear()
        self.dropped = 0
        self.anchor = None if step is None else int(step)
        self.audited()

    def audited(self) -> None:
        """An audit compared the trace (whatever its verdict): the trace, and what is new, start afresh.

        The entries stay (a divergent audit's answer was located from them); a transient divergence is
        looked for only among the steps recorded after this audit, so what it reported is never repeated.
        """
        self.trace = self._trace_before = 0
        self.recorded = 0

    def encode(self, *, recent: bool = False) -> bytes:
        """The ring, to exchange; ``recent``: only the steps recorded since the last audit."""
        entries = list(self.entries)
        dropped = self.dropped
        if recent:
            entries = entries[len(entries) - min(self.recorded, len(entries)) :]
            dropped = max(0, self.recorded - len(entries))
        head = [dropped, NO_STEP if self.anchor is None else self.anchor, self.slices, len(entries)]
        steps = [s for s, _ in entries]
        digests = [d for _, d in entries]
        return np.array(head + steps + digests, dtype=np.int64).tobytes()


_MASK = (1 << 64) - 1


def _fold(trace: int, step: int, digest: int) -> int:
    """One more ``(step, digest)`` in a trace: order-sensitive, 64 bits."""
    h = ((trace ^ (step & _MASK)) * 0x9E3779B97F4A7C15) & _MASK
    return ((h ^ (digest & _MASK)) * 0xC2B2AE3D27D4EB4F + 0x165667B19E3779F9) & _MASK


class Pinpointer:
    """An :class:`~weightsync_audit.Auditor`'s pinpoint: its ring, and the answer for the current divergence.

    Once a divergence is located, the ring stops recording (nothing more to learn, nothing to pay per
    step) and later divergent audits reuse the answer, until an audit finds the replicas in sync again.
    A divergence every part of which is within the tolerance is dated but never freezes the answer: the
    tensors within it are left out of the per-step digests from then on, so a real bug after it is
    dated to its own step.

    ``tensors``: each audited tensor's digests since the last audit, folded (one word per tensor): what
    names the tensors of a divergence that appeared and healed between two audits.
    """

    def __init__(self, capacity: int = DEFAULT_RING, slices: int = 1) -> None:
        self.ring = StepRing(capacity, slices)
        self.found: Pinpoint | None = None
        self.excluded: np.ndarray | None = None
        """Positions in the manifest left out of the per-step digests (found within the tolerance)."""
        self.drift: Pinpoint | None = None
        """Where the divergence within the tolerance was dated, while ``excluded`` is in force."""
        self.tensors: np.ndarray | None = None
        self.names: list[str] = []
        """The audited tensors' names, aligned with ``tensors`` (the manifest of the last step recorded)."""
        self._structure: int | None = None
        self._tensors_before: np.ndarray | None = None
        self._tensors_step: int | None = None
        self.uncovered: set[str] = set()
        """Names of the tensors left out of the per-step digests (held in pieces or by some ranks only)."""
        self.tensor_ring = TensorRing()
        """Each audited tensor's digest per recorded step: each diverged tensor dated to its own step."""
        self.uids: list[str] = []
        """``kind:name`` of the audited tensors, aligned with the per-tensor digests."""

    def record_step(self, step: int, prepare: Callable[[], PreparedManifest], method: str = "auto") -> int | None:
        """Digest, locally, everything the audit's manifest (``prepare()``) covers after optimizer ``step``;
        the digest when it covers every byte (no sampling), else ``None``."""
        if self.found is not None:
            return None  # this divergence is located already: nothing to record until the replicas agree again
        prepared, n = prepare(), self.ring.slices  # the audit's cached manifest: no per-tensor work per step
        digests = prepared.digests(slice_index=step % n, slices=n, method=method)
        if self.excluded is not None and len(digests) > int(self.excluded.max(initial=-1)):
            digests = digests.copy()
            digests[self.excluded] = 0
        if prepared.structure != self._structure:  # the audited set changed: keep each tensor's trace
            self._realign([e.name for e in prepared.manifest.entries])
            self.uids = [e.uid for e in prepared.manifest.entries]
            self._structure = prepared.structure
        shared, structure = digests, prepared.structure
        if prepared.sharded:  # its entries name the peer sets (made again from a cached snapshot)
            shared, structure = self._shared_only(prepared.manifest.entries, digests)
            digests = np.where([e.shard is None for e in prepared.manifest.entries], digests, 0)  # keep positions
        self._fold_tensors(int(step), digests)
        if n == 1:  # sampled digests date nothing exactly
            self.tensor_ring.record(int(step), digests, prepared.structure)
        digest = overall_digest(shared, structure)
        self.record(step, digest)
        return digest if n == 1 else None

    def _shared_only(self, entries: Sequence[Any], digests: np.ndarray) -> tuple[np.ndarray, int]:
        """The digests and structure of the tensors every rank holds whole (no ``shard``); the others'
        names go to :attr:`uncovered`."""
        shared = np.array([e.shard is None for e in entries], dtype=bool)
        self.uncovered = {e.name for e, keep in zip(entries, shared) if not keep}
        return np.asarray(digests)[shared], structure_digest([e for e, keep in zip(entries, shared) if keep])

    def _realign(self, names: list[str]) -> None:
        """Carry each tensor's trace over to a new manifest by name (a tensor new in it starts afresh), so a
        difference that healed before the audited set grew (Adam's state appearing for a layer unfrozen
        later) is still named."""
        if names == self.names:
            return
        where = {n: i for i, n in enumerate(names)}
        if len(where) == len(names):
            for attr in ("tensors", "_tensors_before"):
                old = getattr(self, attr)
                if old is not None and len(old) == len(self.names):
                    new = np.zeros(len(names), dtype=np.uint64)
                    for i, n in enumerate(self.names):
                        if n in where:
                            new[where[n]] = old[i]
                    setattr(self, attr, new)
        self.names = names

    def _fold_tensors(self, step: int, digests: np.ndarray) -> None:
        if self._tensors_step == step:  # the same step again (gradient accumulation): replace it
            base = self._tensors_before
        else:
            base = self._tensors_before = self.tensors
        if base is None or len(base) != len(digests):
            base = np.zeros(len(digests), dtype=np.uint64)
        self.tensors = (base ^ digests.view(np.uint64)) * _TENSOR_MIX
        self._tensors_step = step

    def record(self, step: int, digest: int) -> None:
        """This rank's digest of everything audited after ``step`` (slice ``step % slices`` when sampled)."""
        if self.found is None:
            self.ring.record_digest(step, digest)

    def _forget(self) -> None:
        self.found = None
        self.tensors = self._tensors_before = None
        self._tensors_step = None

    def in_sync(self, step: int | None, *, proven: bool = True) -> None:
        """Every rank held the same values at ``step`` (an in-sync audit)."""
        self._forget()
        self.excluded = self.drift = None
        self.ring.mark_in_sync(step, proven=proven)
        if proven and step is not None:
            self.tensor_ring.trim(int(step))

    def restart(self, step: int | None) -> None:
        """Every rank was made to hold the same values at ``step`` (a confirmed resync): the rings restart."""
        self._forget()
        self.excluded = self.drift = None
        self.ring.restart(step)
        self.tensor_ring.restart()

    @property
    def position(self) -> str:
        """Part of the audit position: ranks must agree on whether the rings are exchanged again."""
        return " pinpoint=located" if self.found is not None else ""

    def ring_word(self) -> int:
        """The summary's ``ring`` word: this rank's trace since the last audit."""
        return self.ring.trace >> 1

    def find_transient(self, comm: Comm, names: Sequence[str]) -> dict[str, Any]:
        """A divergence that appeared and healed since the last audit (:func:`transient_from`). Collective, off
        the healthy path: every rank calls it when the summaries' ring words differ."""
        rings = comm.exchange_bytes(self.ring.encode(recent=True), "the pinpoint rings")
        mine = b"" if self.tensors is None else self.tensors.tobytes()
        if self.tensors is not None and len(self.names) == len(self.tensors):
            names = self.names  # the manifest the traces were folded over (the audit's may have changed since)
        return transient_from(rings, comm.exchange_bytes(mine, "the per-tensor traces"), names)

    def settle(
        self,
        comm: Comm,
        diverged: bool,
        step: int | None,
        proven: bool,
        tolerated: Sequence[int] | None = None,
        names: Sequence[str] = (),
    ) -> Pinpoint | None:
        """After an audit's verdict (the same on every rank): locate a divergence, or trim the ring.

        ``tolerated``: on a divergence every part of which is within the tolerance, the manifest positions
        of those tensors; the divergence is dated, and the ring goes on without them. ``names``: the
        diverged tensors (the same on every rank), see :meth:`_locate`.
        """
        if diverged and tolerated is None:
            return self.diverged(comm, names)
        if not diverged:
            self.in_sync(step, proven=proven)
            return None
        pin = self.found or self._locate(comm, names)
        if self.drift is not None:
            # Nothing new beyond what is left out: the drift's own date stands; something new: the bytes
            # still differed first at the drift's step.
            pin = self.drift if pin.state == "unseen" else with_drift(self.drift, pin)
        self.drift = pin
        known = [] if self.excluded is None else self.excluded.tolist()
        self.excluded = np.array(sorted(set(known) | set(tolerated)), dtype=np.int64)
        self._forget()
        if proven:
            self.ring.restart(step)  # what it holds includes the tensors now left out
            self.tensor_ring.restart()
        else:
            self.ring.mark_in_sync(step, proven=False)
        return pin

    def _locate(self, comm: Comm, names: Sequence[str]) -> Pinpoint:
        """Collective: exchange the rings, each with a flag per diverged tensor (``names``, the same on every
        rank) that this rank left out of its per-step digests; any flag makes the answer ``unavailable``."""
        flags = np.array([n in self.uncovered for n in names], dtype=np.uint8).tobytes()
        tail = len(flags)
        blobs = comm.exchange_bytes(self.ring.encode() + flags, "the pinpoint rings")
        left = [n for j, n in enumerate(names) if any(b[len(b) - tail + j] for b in blobs)] if tail else []
        if left:
            return Pinpoint(
                state="unavailable",
                note=f"pinpoint unavailable: {brief_names(sorted(set(left)))} is held in pieces or by some ranks "
                "only (a shard, or its state), and the per-step digests cover only the tensors every rank holds "
                "whole, so the step this divergence began cannot be told from them",
            )
        pin = locate([b[: len(b) - tail] for b in blobs], comm.global_ranks)
        if self.ring.slices == 1 and names:  # every rank alike: the configuration and the names agree
            uids = [f"{k}:{n}" for n in dict.fromkeys(names) for k in KINDS][: len(KINDS) * MAX_DATED]
            where = {u: i for i, u in enumerate(self.uids)}
            pin.tensor_steps = date_tensors(
                comm, self.tensor_ring, [where.get(u, -1) for u in uids], uids, self.ring.anchor
            )
        return pin

    def diverged(self, comm: Comm, names: Sequence[str] = ()) -> Pinpoint:
        """Collective: every rank calls it when an audit found a divergence; the same answer everywhere.

        The audit reported what the trace holds: it starts afresh, so a later in-sync audit never
        reports this divergence again as a transient one.
        """
        if self.found is None:
            pin = self._locate(comm, names)
            self.found = pin if self.drift is None else with_drift(self.drift, pin)
        self.ring.audited()
        self.tensors = self._tensors_before = None
        self._tensors_step = None
        return self.found


_TENSOR_MIX = np.uint64(0x9E3779B97F4A7C15)


def mark_pinpoint(result: AuditResult, pin: Pinpoint | None) -> None:
    """Write what pinpoint found into a divergent ``result`` (``pinpoint: "off"`` without it)."""
    if result.in_sync:
        return
    result.pinpoint = "off" if pin is None else pin.state
    if pin is not None:
        for m in result.mismatches:  # each tensor's own first step, where dated exactly
            m.first_diverged_step = (pin.tensor_steps or {}).get(f"{m.kind}:{m.name}")
        result.first_diverged_step = pin.first_diverged_step
        if pin.last_in_sync_step is not None:
            result.last_in_sync_step = pin.last_in_sync_step
        if pin.note:
            result.notes.append(pin.note)
