"""How ranks talk during an audit: a star over a dedicated gloo group, every wait bounded.

Why not ``all_gather``: a collective that a rank never joins blocks the others until the process group's
own timeout (30 minutes by default) and then fails without saying who was missing. Here every message
goes through the group's first rank (the coordinator) with point-to-point sends whose waits carry a
deadline. The coordinator knows exactly which ranks arrived and tells the others, so every rank raises
:class:`~weightsync_audit.AuditTimeoutError` naming the same missing ranks. A dedicated gloo group keeps
these small CPU messages apart from the training traffic (which may be NCCL) and gives per-call timeouts.

Without an initialised process group everything here is a no-op over a world of one, so the engine runs,
and is tested, in one process.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from weightsync_audit.errors import AuditTimeoutError

__all__ = ["Comm", "DEFAULT_GRACE_S"]

DEFAULT_GRACE_S = 5.0
"""Extra seconds a rank waits for the coordinator's answer beyond ``timeout_s``: the coordinator may
itself spend up to ``timeout_s`` waiting for a late rank before it answers."""

_NO_DEADLINE_S = 30 * 60.0

_OK, _MISSING = 1, 2


class _AuditGroup:
    """A gloo process group for audit messages, shared by every Comm over the same ranks."""

    def __init__(self, pg: Any, ranks: tuple[int, ...]) -> None:
        self.pg = pg
        self.ranks = ranks
        self.broken: str | None = None
        # Buffers of operations that timed out stay referenced: gloo may still write into them.
        self.graveyard: list[Any] = []
        self.lock = threading.Lock()


_groups: dict[tuple[int, tuple[int, ...]], tuple[Any, _AuditGroup]] = {}
_groups_lock = threading.Lock()


def _audit_group(ranks: tuple[int, ...], timeout_s: float) -> _AuditGroup:
    default_pg = dist.distributed_c10d._get_default_group()
    key = (id(default_pg), ranks)
    with _groups_lock:
        hit = _groups.get(key)
        if hit is not None and hit[0] is default_pg:
            return hit[1]
        # Only the member ranks take part in creating the group (use_local_synchronization), so an
        # audit over a subgroup never waits on ranks outside it.
        pg = dist.new_group(
            ranks=list(ranks),
            backend="gloo",
            timeout=timedelta(seconds=max(timeout_s, 1.0)),
            use_local_synchronization=True,
        )
        group = _AuditGroup(pg, ranks)
        _groups[key] = (default_pg, group)
        return group


def forget_groups() -> None:
    """Drop cached audit groups (after ``destroy_process_group``); the next audit makes new ones."""
    with _groups_lock:
        for _, group in _groups.values():
            try:
                dist.destroy_process_group(group.pg)
            except Exception:  # noqa: BLE001 - the default group may already be gone
                pass
        _groups.clear()


class Comm:
    """Gather and share small messages among the ranks of ``group`` with a deadline.

    >>> Comm().exchange(np.array([7], dtype=np.int64)).tolist()
    [[7]]
    """

    def __init__(self, group: Any = None, timeout_s: float | None = None, grace_s: float = DEFAULT_GRACE_S) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be a positive number of seconds or None")
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.user_group = group
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the audit's `group`")
            if group is None or group is dist.group.WORLD:
                self.global_ranks: tuple[int, ...] = tuple(range(self.world_size))
            else:
                self.global_ranks = tuple(dist.get_process_group_ranks(group))
        else:
            self.world_size, self.rank, self.global_ranks = 1, 0, (0,)
        self._group: _AuditGroup | None = None

    # -- set-up --------------------------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def _deadline_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else _NO_DEADLINE_S

    def setup(self) -> None:
        """Create the dedicated audit group now (collective over the group's ranks)."""
        if self.distributed and self._group is None:
            self._group = _audit_group(self.global_ranks, self._deadline_s() + self.grace_s)

    def _pg(self) -> _AuditGroup:
        self.setup()
        assert self._group is not None
        if self._group.broken:
            raise AuditTimeoutError(
                f"the audit channel is unusable after an earlier failure ({self._group.broken}); "
                "ranks can no longer be compared in this process group"
            )
        return self._group

    # -- point-to-point with deadlines ---------------------------------------------------------

    def _wait(self, group: _AuditGroup, work: Any, buf: torch.Tensor, deadline: float) -> bool:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("deadline passed")
            work.wait(timeout=timedelta(seconds=left))
            return True
        except Exception:  # noqa: BLE001 - gloo raises RuntimeError subclasses for timeouts and lost peers
            group.graveyard.append((work, buf))
            return False

    def _fail(self, group: _AuditGroup, missing: Sequence[int], what: str) -> AuditTimeoutError:
        missing_global = [self.global_ranks[i] for i in missing]
        group.broken = f"rank(s) {missing_global} did not arrive at {what}"
        limit = f"within {self.timeout_s:g}s" if self.timeout_s is not None else "before the deadline"
        return AuditTimeoutError(
            f"weightsync audit: rank(s) {missing_global} did not arrive at {what} {limit} "
            f"(this is rank {self.global_ranks[self.rank]} of {self.world_size}); a rank is stuck, "
            "dead, or auditing at a different point",
            missing_global,
        )

    def _star(self, payload: torch.Tensor, reply_len: int, what: str, recv_len: Sequence[int] | None = None) -> torch.Tensor:
        """Non-coordinators send ``payload`` to the coordinator and receive ``reply_len`` int64 words.

        ``recv_len[r]`` is the length the coordinator expects from rank ``r`` (default: the same as its
        own payload). The coordinator's reply starts with a status word and, when ranks are missing,
        a 0/1 mask of them.
        """
        group = self._pg()
        pg = group.pg
        start = time.monotonic()
        w = self.world_size
        if self.rank == 0:
            deadline = start + self._deadline_s()
            bufs: list[torch.Tensor | None] = [None] * w
            works = []
            for r in range(1, w):
                n = payload.numel() if recv_len is None else recv_len[r]
                buf = torch.empty(n, dtype=payload.dtype)
                bufs[r] = buf
                works.append((r, dist.irecv(buf, src=self.global_ranks[r], group=pg) if n else None, buf))
            missing = [r for r, work, buf in works if work is not None and not self._wait(group, work, buf, deadline)]
            table = self._coordinator_table(payload, bufs, missing)
            status = torch.tensor([_OK if not missing else _MISSING], dtype=torch.int64)
            mask = torch.zeros(w, dtype=torch.int64)
            mask[missing] = 1
            reply = torch.cat([status, mask, table]) if table.dtype == torch.int64 else None
            if reply is None:  # byte payloads: status and mask as bytes in front
                reply = torch.cat([status.view(torch.uint8), mask.view(torch.uint8), table])
            send_deadline = time.monotonic() + self.grace_s
            for r in range(1, w):
                if r in missing:
                    continue
                work = dist.isend(reply, dst=self.global_ranks[r], group=pg)
                if not self._wait(group, work, reply, send_deadline):
                    missing.append(r)
            if missing:
                raise self._fail(group, sorted(set(missing)), what)
            return table
        deadline = start + self._deadline_s() + self.grace_s
        if payload.numel():
            work = dist.isend(payload, dst=self.global_ranks[0], group=pg)
            if not self._wait(group, work, payload, deadline):
                raise self._fail(group, [0], what)
        header = 8 * (1 + w) if payload.dtype == torch.uint8 else 1 + w
        reply = torch.empty(header + reply_len, dtype=payload.dtype)
        work = dist.irecv(reply, src=self.global_ranks[0], group=pg)
        if not self._wait(group, work, reply, deadline):
            raise self._fail(group, [0], what)
        if payload.dtype == torch.uint8:
            status = int(reply[:8].view(torch.int64)[0])
            mask = reply[8:header].view(torch.int64)
        else:
            status, mask = int(reply[0]), reply[1:header]
        if status != _OK:
            raise self._fail(group, [int(i) for i in torch.nonzero(mask).flatten().tolist()], what)
        return reply[header:]

    def _coordinator_table(self, own: torch.Tensor, bufs: list[torch.Tensor | None], missing: list[int]) -> torch.Tensor:
        parts = [own]
        for r in range(1, self.world_size):
            buf = bufs[r]
            assert buf is not None
            parts.append(torch.zeros_like(buf) if r in missing else buf)
        return torch.cat(parts)

    # -- public exchanges ----------------------------------------------------------------------

    def exchange(self, payload: np.ndarray, what: str = "the audit") -> np.ndarray:
        """Every rank's fixed-length int64 vector, as a ``[world, L]`` array, on every rank."""
        row = np.ascontiguousarray(payload, dtype=np.int64).reshape(-1)
        if not self.distributed:
            return row.reshape(1, -1).copy()
        table = self._star(torch.from_numpy(row.copy()), self.world_size * row.size, what)
        return table.numpy().reshape(self.world_size, row.size)

    def exchange_bytes(self, payload: bytes, what: str = "the audit") -> list[bytes]:
        """Every rank's byte string, of any length, on every rank."""
        if not self.distributed:
            return [bytes(payload)]
        lengths = self.exchange(np.array([len(payload)], dtype=np.int64), what)[:, 0].tolist()
        own = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
        table = self._star(own, int(sum(lengths)), what, recv_len=lengths).numpy().tobytes()
        out, pos = [], 0
        for n in lengths:
            out.append(table[pos : pos + n])
            pos += n
        return out

    def share_bytes(self, src: int, payload: bytes | None, what: str = "the audit") -> bytes:
        """Rank ``src``'s bytes on every rank (the others pass ``None``)."""
        data = payload if self.rank == src else b""
        return self.exchange_bytes(data or b"", what)[src]
