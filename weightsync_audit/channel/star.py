"""How ranks talk during an audit: a star over a dedicated gloo group, every wait bounded.

Why not ``all_gather``: a collective that a rank never joins blocks the others until the process group's
own timeout (30 minutes by default) and then fails without saying who was missing. Here every message
goes through the group's first rank (the coordinator) with point-to-point sends whose waits carry a
deadline. The coordinator knows exactly which ranks arrived and tells the others, so every rank raises
:class:`~weightsync_audit.AuditTimeoutError` naming the same missing ranks.

One exchange is a *round*: each rank sends its bytes to the coordinator, which applies a rule to the list
(a pure function, the same on any rank) and sends every rank the same answer. The healthy audit's rule
answers a fixed-size verdict, so rank 0 sends 72 bytes per peer and every other rank 256 bytes in all
(the 104-byte summary in a 184-byte frame up, 72 down), whatever the number of ranks; only :meth:`Comm.exchange` answers everyone's bytes to
everyone. In a large group the star becomes a tree, per host then across hosts
(:class:`TreeWire`, below), with the same rounds and failure verdicts. A dedicated gloo group
keeps these small CPU messages apart from the training traffic (which may be NCCL) and gives per-call
timeouts.

What gloo does on failure (a timed-out wait closes every pair of the process's context; a message
larger than its receive buffer aborts the process) shapes the protocol: the failure verdicts also go
through the job's store (:mod:`~weightsync_audit.channel.verdicts`, which says how), and every message
starts with a frame that names its exchange (:mod:`~weightsync_audit.channel.wire`), so a rank at
another point of the protocol is reported as :class:`~weightsync_audit.AuditOutOfStepError` on every
rank, never a crash.

Opening the audit group is itself collective; before ``new_group`` the ranks meet in the store with the
same deadline, so a rank that never reaches its first audit is named as well.

After any failure the group is marked broken: later audits in this process raise at once instead of
waiting on a channel whose peers are gone or out of step.

Without an initialised process group everything here is a no-op over a world of one, so the engine runs,
and is tested, in one process.

**The tree** (:class:`TreeWire`): each host's ranks through their leader, the leaders through the coordinator.

A star's coordinator (:mod:`~weightsync_audit.channel.star`) spends about 0.08 ms of CPU per peer and round
(docs/performance.md, the fleet on paper). Here the ranks are cut into blocks of ``k`` consecutive ranks
(whole hosts), the first of each its *leader*. Every round takes the tree (``decide``, ``exchange``,
``share_bytes``): a rank sends its bytes to its leader, a leader its block's bytes in one message to the
coordinator (block 0's leader), which applies the rule to every rank's bytes in rank order as in a star;
the answer goes back down. The coordinator handles ``k - 1 + W / k`` peers, a leader ``k``.

The coordinator decides the blocks once, when the channel opens (it then learns where each rank runs), and
tells every rank: ``WEIGHTSYNC_AUDIT_RANKS_PER_HOST`` ranks when that variable is set on it (tests and
benchmarks force a tree on one machine so); else a tree only past ``WEIGHTSYNC_AUDIT_FAN_IN`` ranks
(default 256), in blocks of whole hosts and of at least sqrt(W) ranks: at most about 2 sqrt(W) peers per
process (254 at 16,384 ranks). Never with a member on the previous release.

Failures are named alike on every rank, as in a star. Deadlines nest: a leader waits ``timeout_s`` for its
block, the coordinator ``timeout_s`` + grace / 2 for the leaders, so that a late rank is named by its
leader; every rank waits ``timeout_s`` + grace for its answer, then reads the verdict in the store. A leader
reports the ranks it lost or found out of step instead of its block's bytes. A leader lost is named with
its whole block (the coordinator cannot tell its ranks from it). A timed-out gloo wait closes every
connection of its process, so a leader that waited out a rank leaves its report in the store, where the
coordinator looks when that leader's connection closes. A leader that loses the coordinator hands its
block the verdict it found in the store (or one naming the coordinator).
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import timedelta
from typing import Any, Callable, Hashable

import numpy as np
import torch.distributed as dist

from weightsync_audit.channel.groups import AuditGroup, forget_groups, open_group
from weightsync_audit.channel.verdicts import (
    STORE_WAIT_S,
    WaitFailure,
    Who,
    no_answer,
    out_of_step_error,
)
from weightsync_audit.channel.wire import (
    MISSING,
    OUT_OF_STEP,
    REQ_WORDS,
    Rule,
    StarWire,
    as_bytes,
    compact_rows,
    expand_rows,
    join_parts,
    split_parts,
)
from weightsync_audit.compat import default_process_group, describe_this_rank, new_named_gloo_group

__all__ = [
    "DEFAULT_FAN_IN",
    "DEFAULT_GRACE_S",
    "FAN_IN_ENV",
    "RANKS_PER_HOST_ENV",
    "Comm",
    "Rule",
    "Tail",
    "TreeWire",
    "block_size",
    "forget_groups",
]

RANKS_PER_HOST_ENV = "WEIGHTSYNC_AUDIT_RANKS_PER_HOST"
FAN_IN_ENV = "WEIGHTSYNC_AUDIT_FAN_IN"
DEFAULT_FAN_IN = 256
_PARTS, _REPORT = b"P", b"R"


def _env_ranks(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name}={raw!r}: must be a positive whole number of ranks")
    return int(raw)


def block_size(hosts: list[str]) -> int:
    """Ranks per block of the tree for ranks that run where ``hosts`` say (in rank order), from this
    process's variables; 0 for a star.

    >>> block_size(["a"] * 8 + ["b"] * 8), block_size([f"h{i // 8}" for i in range(1024)])
    (0, 32)
    """
    w = len(hosts)
    k = _env_ranks(RANKS_PER_HOST_ENV, 0)
    if not k:
        if w <= _env_ranks(FAN_IN_ENV, DEFAULT_FAN_IN):
            return 0
        names = [h.split(" ", 1)[0] for h in hosts]
        per_host = next((i for i, n in enumerate(names) if n != names[0]), w)
        k = -(-max(per_host, math.isqrt(w - 1) + 1) // per_host) * per_host
    return k if k < w else 0


class TreeWire(StarWire):
    """The leaders' part of a round, and the coordinator's reading of what leaders send."""

    def _relay(self, group: AuditGroup, seq: int, body: bytes, what: str) -> bytes:
        k = group.block
        if k and self.rank % k == 0:
            return self._lead(group, seq, body, what)
        return self._participate(group, seq, body, what, self.rank - self.rank % k if k else 0)

    def _lead(self, group: AuditGroup, seq: int, body: bytes, what: str) -> bytes:
        start = time.monotonic()
        children = self._children(self.rank)
        skip, group.pending = (group.pending[1] if group.pending else frozenset()), None
        got, failures, positions = self._gather_frames(group, seq, what, skip, children, start + self._deadline_s())
        missing = self._missing(group, seq, failures, self.rank) if failures else []
        report = json.dumps({"missing": missing, "positions": {str(r): p for r, p in positions.items()}})
        if missing or positions:
            up = _REPORT + report.encode()
        else:
            up = _PARTS + join_parts([body] + [got[c] for c in children])
        deadline = start + self._deadline_s() + self.grace_s
        try:
            if any(f.timed_out for f in failures.values()):
                group.store.set(f"block/{seq}/{self.rank}", report)
                raise WaitFailure(False, "this leader's connections closed when it waited out a rank")
            status, data = self._ask(group, seq, up, what, 0, deadline)
        except WaitFailure as failure:
            wait = max(deadline - time.monotonic(), 0.0) + STORE_WAIT_S
            verdict, error = no_answer(self._who, group, seq, what, failure, 0, wait)
            status = MISSING if verdict.get("missing") else OUT_OF_STEP
            self._answer(group, seq, status, json.dumps(verdict).encode(), failures, children)
            raise error from None
        lost = self._answer(group, seq, status, data, failures, children)
        if lost:  # named at the next exchange, as the coordinator does with its own
            group.pending = ({}, frozenset(lost))
        return self._settle(group, status, data, what)

    def _unfold(self, c: int, body: bytes, datas: list[bytes], missing: list[int], positions: dict[int, str]) -> None:
        if c % self._block:
            datas[c] = body
        elif body[:1] == _PARTS:
            block = self._subtree(c)
            for p, part in zip(block, split_parts(body[1:], len(block))):
                datas[p] = part
        else:
            report = json.loads(body[1:])
            missing += report["missing"]
            positions.update({int(r): p for r, p in report["positions"].items()})

    def _recover(self, group: AuditGroup, seq: int, failures: dict[int, WaitFailure], missing: list[int]) -> None:
        for c in [c for c, f in failures.items() if group.block and c % group.block == 0 and not f.timed_out]:
            raw = group.store.wait_get(f"block/{seq}/{c}", 1.0, 1.5)
            if raw is not None:
                del failures[c]
                missing += json.loads(raw)["missing"]


DEFAULT_GRACE_S = 5.0
"""Extra seconds a rank waits for the coordinator's answer beyond ``timeout_s``: the coordinator may
itself spend up to ``timeout_s`` waiting for a late rank before it answers."""

_NO_DEADLINE_S = 30 * 60.0


Tail = Callable[[np.ndarray, list[bytes]], bytes]
"""What the coordinator adds to a table exchange (:meth:`Comm.exchange_then`): from the gathered table and
every rank's blob, the bytes every rank gets with the table."""


class Comm(TreeWire):
    """Gather and share small messages among the ranks of ``group`` with a deadline.

    >>> Comm().exchange(np.array([7], dtype=np.int64)).tolist()
    [[7]]
    >>> Comm().decide(b"abc", lambda parts: max(parts))
    b'abc'
    """

    def __init__(self, group: Any = None, timeout_s: float | None = None, grace_s: float = DEFAULT_GRACE_S) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be a positive number of seconds or None")
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.world_size, self.rank, self.global_ranks = self.membership(group)
        self._group: AuditGroup | None = None
        self._pg_ranks: tuple[Any, list[int]] | None = None
        """The last group :meth:`post` used, and each member's rank in it."""
        self._who = Who(self.rank, self.world_size, self.global_ranks, timeout_s)

    def membership(self, group: Any) -> tuple[int, int, tuple[int, ...]]:
        """``(world size, this rank's position, every member's global rank)`` of the channel over ``group``.

        Here the members of a ``torch.distributed`` group (the world when ``None``; a world of one without
        an initialised process group). A channel over ranks that ``torch.distributed`` does not know (a
        torchft quorum's replicas, :mod:`weightsync_audit.integrations.torchft`) overrides it, with
        :meth:`post` and :meth:`side_group`."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1, 0, (0,)
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the audit's `group`")
        if group is None or group is dist.group.WORLD:
            return world_size, rank, tuple(range(world_size))
        return world_size, rank, tuple(dist.get_process_group_ranks(group))

    def post(self, pg: Any, t: Any, peer: int, send: bool) -> Any:
        """Post one point-to-point message of ``t`` to (``send``) or from the member at position ``peer``, on
        ``pg`` (a process group over this channel's members): its work, to wait on with a deadline."""
        # The group's own send and recv, as ``dist.isend``/``dist.irecv`` end up calling them, without their
        # per-call checks (a plain CPU tensor, this rank a member): a healthy audit posts two per rank.
        ranks = self._pg_ranks
        if ranks is None or ranks[0] is not pg:
            ranks = self._pg_ranks = (pg, [dist.get_group_rank(pg, g) for g in self.global_ranks])
        return pg.send([t], ranks[1][peer], 0) if send else pg.recv([t], ranks[1][peer], 0)

    def side_group(self, name: str, timeout: timedelta) -> Any:
        """A new gloo group over this channel's members, named ``name`` alike on every member (the data
        plane's, :mod:`~weightsync_audit.channel.dataplane`). Collective over the members."""
        if self.own_names:
            return new_named_gloo_group(self.global_ranks, name, timeout)
        # A member on an earlier release: torch names the group, as that release lets it.
        return dist.new_group(list(self.global_ranks), timeout=timeout, backend="gloo", use_local_synchronization=True)

    def side_key(self) -> Hashable:
        """What identifies this channel's members for the side groups kept open between transfers (the
        default group itself, so that a group made before ``destroy_process_group`` is never reused)."""
        return (default_process_group(), self.global_ranks)

    # -- set-up --------------------------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank has sent over the audit group so far (every Comm over the same ranks counts)."""
        return self._group.sent_bytes if self._group is not None else 0

    def _deadline_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else _NO_DEADLINE_S

    def setup(self) -> None:
        """Create the dedicated audit group now (collective over the group's ranks, with the deadline)."""
        if self.distributed and self._group is None:
            self._group = self.open_members()
            if self._group.hosts is None:  # once per group, every rank at once: where each rank runs
                group = self._group
                group.hosts = []  # the coordinator keeps them (W short lines); the others hold none

                def keep(parts: list[bytes]) -> bytes:  # and the channel's shape (a tree when it is large)
                    group.hosts = [p.decode("utf-8", "replace") for p in parts]
                    return np.array([block_size(group.hosts) if group.own_names else 0], np.int64).tobytes()

                answer = self.decide(describe_this_rank().encode(), keep, "where each rank runs")
                group.block = int(np.frombuffer(answer, np.int64)[0]) if len(answer) == 8 else 0
                if group.block:  # each rank meets its leader while every rank is known to be here
                    self.decide(b"", lambda parts: b"", "the tree's first contact")

    def open_members(self) -> AuditGroup:
        """The members' dedicated gloo group (collective, with the deadline): opened once per set of ranks
        of the job's process group and shared by every Comm over them."""
        return open_group(self.global_ranks, self.rank, self._deadline_s(), self.grace_s)

    def known_hosts(self, ranks: list[int]) -> dict[str, str]:
        """Where ``ranks`` run, as the coordinator knows it (local: meaningful on the group's first rank only)."""
        if not self.distributed:
            return {str(r): describe_this_rank() for r in ranks}
        where = dict(zip(self.global_ranks, self._group.hosts if self._group is not None else []))
        return {str(r): where[r] for r in ranks if r in where}

    def hosts_of(self, ranks: list[int]) -> dict[str, str] | None:
        """Global rank -> where it runs, for ``ranks``, on every rank (collective: the coordinator, which
        gathered every rank's line when the channel opened, shares those of ``ranks`` only)."""
        if not ranks:
            return None
        if not self.distributed:
            return self.known_hosts(ranks)
        mine = json.dumps(self.known_hosts(ranks)).encode() if self.rank == 0 else None
        return json.loads(self.share_bytes(0, mine, "where the odd ranks run")) or None

    @property
    def own_names(self) -> bool:
        """Whether the groups of these ranks are named by this library (every member on this release or
        later) rather than by torch; see :func:`~weightsync_audit.channel.groups.open_group`."""
        return self._group.own_names if self._group is not None else True

    def _broken_error(self, group: AuditGroup) -> Exception:
        return group.broken_kind(
            f"weightsync audit: the audit channel is unusable after an earlier failure ({group.broken}); "
            "ranks can no longer be compared in this process group"
        )

    # -- public exchanges ----------------------------------------------------------------------

    def prime(self) -> None:
        """On the coordinator, as an audit starts: post its children's next receives now, before its digests,
        so that a child done first sends at once (gloo sends only into a posted receive); the next round takes
        them. Never between audits, nor during another thread's round. A coordinator that then outlasts its
        children's deadline names itself, as they do (:meth:`_coordinate`)."""
        group = self._group
        if group is None or group.primed or group.broken or group.pending or self.rank != 0:
            return
        if not group.lock.acquire(blocking=False):
            return
        try:
            for r in self._children(0):
                group.primed[r] = self._post(group, group.frame(("frame", r), REQ_WORDS)[1], r, send=False)
        except WaitFailure:
            group.drop_buffers()
        finally:
            group.lock.release()

    def decide(self, payload: bytes | np.ndarray, rule: Rule, what: str = "the audit") -> bytes:
        """``rule`` of every rank's bytes, computed once by the coordinator, on every rank.

        Every rank must pass the same ``rule`` (a pure function of the list of every rank's bytes, in
        rank order); only the coordinator runs it, so the answer is one message whatever the number of
        ranks. If it raises, every rank raises :class:`~weightsync_audit.AuditPreparationError`.
        """
        if not self.distributed:
            return rule([as_bytes(payload)])
        return self._round(payload, rule, what)

    def exchange(self, payload: np.ndarray, what: str = "the audit", compact: bool = False) -> np.ndarray:
        """Every rank's fixed-length int64 vector, as a ``[world, L]`` array, on every rank. ``compact``:
        the same array, but the answer says only each column's majority value and the cells that differ."""
        row = np.ascontiguousarray(payload, dtype=np.int64).reshape(-1)
        if not self.distributed:
            return row.reshape(1, -1).copy()
        if compact:
            return self.exchange_then(row, what)[0]
        parts = split_parts(self._round(row, join_parts, what), self.world_size)
        lengths = [len(p) for p in parts]
        if any(n != row.nbytes for n in lengths):
            raise self._out_of_step(
                {self.global_ranks[r]: f"{n // 8} value(s) at {what}" for r, n in enumerate(lengths)}, what
            )
        return np.frombuffer(b"".join(parts), dtype=np.int64).reshape(self.world_size, row.size).copy()

    def exchange_within(self, payload: np.ndarray, what: str, extra_s: float) -> np.ndarray:
        """:meth:`exchange` with its deadline lengthened by ``extra_s`` for this one exchange: the time a
        transfer may still take on other ranks, so that a rank done early does not take a busy peer for a
        missing one."""
        return self._within(extra_s, lambda: self.exchange(payload, what))

    def _within(self, extra_s: float, call: Callable[[], Any]) -> Any:
        if self.timeout_s is None or extra_s <= 0:
            return call()
        saved = self.timeout_s
        self.timeout_s = saved + extra_s
        try:
            return call()
        finally:
            self.timeout_s = saved

    def exchange_then(
        self, payload: np.ndarray, what: str, *, blob: bytes = b"", then: Tail | None = None, extra_s: float = 0.0
    ) -> tuple[np.ndarray, bytes]:
        """:meth:`exchange` (compact) of every rank's int64 row, and in the same round what the coordinator
        makes of it: each rank may add ``blob`` bytes that only the coordinator reads, and ``then(table,
        blobs)``, run there alone, answers bytes that every rank gets with the table (``b""`` without
        ``then``). ``extra_s`` lengthens this exchange's deadline as :meth:`exchange_within` does."""
        row = np.ascontiguousarray(payload, dtype=np.int64).reshape(-1)
        if not self.distributed:
            table = row.reshape(1, -1).copy()
            return table, then(table, [bytes(blob)]) if then is not None else b""

        def rule(parts: list[bytes]) -> bytes:
            lengths = [int(np.frombuffer(p[:8], dtype=np.int64)[0]) if len(p) >= 8 else -1 for p in parts]
            compact = compact_rows([p[8 : 8 + n] if n >= 0 else p for p, n in zip(parts, lengths)])
            table = expand_rows(compact, len(parts))
            tail = (
                then(table, [p[8 + n :] for p, n in zip(parts, lengths)])
                if then and isinstance(table, np.ndarray)
                else b""
            )
            return np.array([len(compact)], dtype=np.int64).tobytes() + compact + tail

        answer = self._within(
            extra_s, lambda: self._round(np.array([row.nbytes], np.int64).tobytes() + row.tobytes() + blob, rule, what)
        )
        n = int(np.frombuffer(answer[:8], dtype=np.int64)[0])
        table = expand_rows(answer[8 : 8 + n], self.world_size)
        if not isinstance(table, np.ndarray) or table.shape[1] != row.size:
            lengths = table if not isinstance(table, np.ndarray) else [table.shape[1]] * self.world_size
            raise self._out_of_step(
                {self.global_ranks[r]: f"{k} value(s) at {what}" for r, k in enumerate(lengths)}, what
            )
        return table, answer[8 + n :]

    def _out_of_step(self, sizes: dict[int, str], what: str) -> Exception:
        group = self._group
        assert group is not None
        return out_of_step_error(group, sizes, what)

    def exchange_bytes(self, payload: bytes, what: str = "the audit") -> list[bytes]:
        """Every rank's byte string, of any length, on every rank."""
        if not self.distributed:
            return [bytes(payload)]
        return split_parts(self._round(payload, join_parts, what), self.world_size)

    def share_bytes(self, src: int, payload: bytes | None, what: str = "the audit") -> bytes:
        """Rank ``src``'s bytes on every rank (the others pass ``None``); only those bytes come back."""
        data = payload if self.rank == src else b""
        if not self.distributed:
            return bytes(data or b"")
        return self._round(data or b"", lambda parts: parts[src], what)
