"""The data plane: bulk bytes (reference copies, resync) straight between two ranks, every wait bounded
by a deadline that grows with the bytes moved.

The star (:mod:`~weightsync_audit.channel.star`) carries the fixed-size summaries that prove every rank
arrived. What follows a disagreement can be large (a 1 GiB reference copy), so it does not go through
the coordinator: the rank that holds the bytes sends them, in chunks of ``CHUNK_BYTES``, to the ranks
that need them, and each chunk's wait ends at ``start + grace_s + bytes_so_far / FLOOR_BYTES_PER_S``
(:class:`Schedule`), so a slow but live transfer is never mistaken for a dead rank, and a dead or
stopped one is given up on after a time proportional to what was asked of it.

The data plane has its own gloo group, opened once all ranks are known present (right after a star
exchange). Why not the audit group: a gloo wait that times out closes every connection of its
group in that process, which would break the star too. Here a failed transfer breaks only the data
group; the ranks then tell each other over the star what failed (so they all decide alike) and
:meth:`DataPlane.discard` it; the next transfer opens a fresh one. Retired groups are kept, never
destroyed mid-run, so that a new group's name (and store keys) can never collide with an old one's.
"""

from __future__ import annotations

import atexit
import threading
import time
from datetime import timedelta
from typing import Any, Hashable, Sequence

import torch
import torch.distributed as dist

from weightsync_audit.channel.star import Comm
from weightsync_audit.channel.verdicts import WaitFailure, wait_until
from weightsync_audit.compat import is_timeout_text

__all__ = [
    "CHUNK_BYTES",
    "FLOOR_BYTES_PER_S",
    "DataPlane",
    "Schedule",
    "TransferFailure",
    "forget_data_groups",
]

CHUNK_BYTES = 4 << 20
"""Bytes per message of the data plane: what a rank holds at once of a transfer, per peer."""

FLOOR_BYTES_PER_S = 32 << 20
"""The slowest transfer rate the deadlines allow for (32 MiB/s; gloo over loopback moves 1-3 GiB/s)."""


class TransferFailure(Exception):
    """A transfer with ``peer`` (a position in the group; ``None``: the group itself) failed."""

    def __init__(self, peer: int | None, timed_out: bool, why: str) -> None:
        self.peer = peer
        self.timed_out = timed_out
        super().__init__(why)


class Schedule:
    """Deadlines for a run of transfers that start together: ``start + grace_s + bytes / floor``.

    Every rank makes the same plan, so the ``bytes`` a chunk's deadline is computed from are the bytes
    of the whole plan up to and including that chunk, whichever ranks move them: a rank that waits for
    a peer still busy with an earlier transfer waits long enough.

    >>> s = Schedule(5.0, start=0.0)
    >>> s.deadline(FLOOR_BYTES_PER_S * 2)
    7.0
    """

    def __init__(self, grace_s: float, start: float | None = None) -> None:
        self.grace_s = grace_s
        self.start = time.monotonic() if start is None else start

    @staticmethod
    def bound_s(nbytes: int, grace_s: float) -> float:
        """Seconds allowed for ``nbytes``: ``grace_s + nbytes / FLOOR_BYTES_PER_S``."""
        return grace_s + nbytes / FLOOR_BYTES_PER_S

    def deadline(self, bytes_through: int) -> float:
        return self.start + self.bound_s(bytes_through, self.grace_s)

    def left_s(self, total_bytes: int) -> float:
        """Seconds left until the whole plan's deadline (0 once past it)."""
        return max(0.0, self.deadline(total_bytes) - time.monotonic())


class _DataGroup:
    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.dead: str | None = None
        """Set after a wait timed out: gloo closed every connection of this group in this process."""
        self.graveyard: list[Any] = []
        """Buffers of failed operations: gloo may still write into them."""


_groups: dict[Hashable, _DataGroup] = {}
"""The open data group per channel (:meth:`Comm.side_key`: the default group's identity and the ranks)."""
_retired: list[_DataGroup] = []
_openings: dict[tuple[int, ...], int] = {}
"""How many data groups this process opened per set of ranks: every member opens and discards them alike,
so the count names the same group on every member (its gloo name, see ``new_named_gloo_group``)."""
_lock = threading.Lock()


class DataPlane:
    """Chunked, deadlined point-to-point transfers among the ranks of ``comm``.

    Without a process group (a world of one) there is nothing to move and :meth:`open` does nothing.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._group: _DataGroup | None = None

    def _key(self) -> Hashable:
        return self.comm.side_key()

    def open(self, deadline_s: float) -> None:
        """Open (or reuse) the data group. Collective: every rank of ``comm`` calls it at the same point,
        once they are known present. Raises :class:`TransferFailure` when it cannot be opened."""
        if not self.comm.distributed or self._group is not None:
            return
        key = self._key()
        with _lock:
            hit = _groups.get(key)
            if hit is not None:
                self._group = hit
                return
            ranks = self.comm.global_ranks
            opening = _openings.get(ranks, 0)
            _openings[ranks] = opening + 1
            name = f"weightsync_audit.data:{'.'.join(map(str, ranks))}:{opening}"
            limit = timedelta(seconds=max(deadline_s, 1.0))
            try:
                pg = self.comm.side_group(name, limit)
            except Exception as exc:
                raise TransferFailure(None, is_timeout_text(str(exc)), f"could not open the data plane: {exc}") from exc
            group = _DataGroup(pg)
            _groups[key] = group
            self._group = group

    def discard(self) -> None:
        """Retire the data group after a failure that every rank knows of; the next :meth:`open` makes a
        new one. Call it on every rank alike (decide from gathered data)."""
        if not self.comm.distributed:
            return
        with _lock:
            hit = _groups.pop(self._key(), None)
            if hit is not None:
                _retired.append(hit)
        self._group = None

    def close(self) -> None:
        """Drop the data group of a channel closed for good, whose members never open one again (a torchft
        quorum's channel, made for one audit); unlike :meth:`discard`, nothing is kept. Local."""
        with _lock:
            _groups.pop(self._key(), None)
        self._group = None

    def _ready(self, peer: int) -> _DataGroup:
        group = self._group
        if group is None:
            raise TransferFailure(None, False, "the data plane is not open")
        if group.dead:
            raise TransferFailure(peer, True, group.dead)
        return group

    def _wait(self, group: _DataGroup, work: Any, buf: Any, peer: int, deadline: float, verb: str) -> None:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            wait_until(work, buf, deadline, group.graveyard)
        except WaitFailure as failure:
            who = self.comm.global_ranks[peer]
            if failure.timed_out:
                why = f"{verb} rank {who} did not finish within its deadline ({left:.1f}s left for the chunk)"
                group.dead = why
            else:
                why = f"{verb} rank {who} failed: {str(failure)[:160]}"
            raise TransferFailure(peer, failure.timed_out, why) from failure

    def send(self, buf: torch.Tensor, dsts: Sequence[int], deadline: float) -> dict[int, TransferFailure]:
        """Send one chunk (a contiguous CPU tensor) to each of ``dsts``; the ones that failed, by peer."""
        failed: dict[int, TransferFailure] = {}
        works: list[tuple[int, Any]] = []
        for dst in dsts:
            try:
                group = self._ready(dst)
                works.append((dst, self.comm.post(group.pg, buf, dst, True)))
            except TransferFailure as f:
                failed[dst] = f
            except Exception as exc:  # noqa: BLE001
                failed[dst] = TransferFailure(dst, False, f"sending to rank {self.comm.global_ranks[dst]}: {exc}")
        for dst, work in works:
            try:
                self._wait(self._ready(dst), work, buf, dst, deadline, "sending to")
            except TransferFailure as f:
                failed[dst] = f
        return failed

    def recv(self, buf: torch.Tensor, src: int, deadline: float) -> None:
        """Receive one chunk from ``src`` into ``buf`` (a contiguous CPU tensor of the announced size)."""
        group = self._ready(src)
        try:
            work = self.comm.post(group.pg, buf, src, False)
        except Exception as exc:
            raise TransferFailure(src, False, f"receiving from rank {self.comm.global_ranks[src]}: {exc}") from exc
        self._wait(group, work, buf, src, deadline, "receiving from")


def forget_data_groups() -> None:
    """Drop the data groups (current and retired), e.g. after ``destroy_process_group``; the next
    transfer opens a new one. Destroys what it can; the default group may already be gone."""
    with _lock:
        groups = list(_groups.values()) + _retired
        _groups.clear()
        _retired.clear()
    for group in groups:
        try:
            if dist.is_initialized():
                dist.destroy_process_group(group.pg)
        except Exception:  # noqa: BLE001 - already destroyed with the default group
            pass


# Torn down at exit like the audit groups (channel/groups.py), before torch's own teardown runs.
atexit.register(forget_data_groups)
