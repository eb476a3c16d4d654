"""How ranks talk during an audit: a star over a dedicated gloo group, every wait bounded.

Why not ``all_gather``: a collective that a rank never joins blocks the others until the process group's
own timeout (30 minutes by default) and then fails without saying who was missing. Here every message
goes through the group's first rank (the coordinator) with point-to-point sends whose waits carry a
deadline. The coordinator knows exactly which ranks arrived and tells the others, so every rank raises
:class:`~weightsync_audit.AuditTimeoutError` naming the same missing ranks.

One exchange is a *round*: each rank sends its bytes to the coordinator, which applies a rule to the list
(a pure function, the same on any rank) and sends every rank the same answer. The healthy audit's rule
answers a fixed-size verdict, so rank 0 sends 72 bytes per peer and every other rank 224 bytes in all
(152 up, 72 down), whatever the number of ranks; only :meth:`Comm.exchange` answers everyone's bytes to everyone. A dedicated gloo group keeps
these small CPU messages apart from the training traffic (which may be NCCL) and gives per-call timeouts.

What gloo does on failure shapes the protocol (measured with torch 2.13):

* A ``wait(timeout)`` that expires closes *every* pair of that process's gloo context ("Application
  timeout caused pair closure"), so after waiting out a late rank the coordinator can no longer answer
  the punctual ones over gloo. The verdict therefore also goes through the job's key-value store (the
  one ``init_process_group`` set up), under a key per exchange; a rank whose gloo reply fails reads it
  there. Only failures touch the store: a healthy exchange is one gloo message up and one down per rank.
  Every store call is bounded (:mod:`~weightsync_audit.channel.storelink`): a stopped store host
  cannot hold a rank past ``timeout_s`` + grace.
* When the coordinator cannot answer a rank after the others already have their answer (that rank died
  or gave up), the answer stands for this exchange on every rank that has it, and the coordinator
  delivers the failure verdict at the next exchange, so the survivors all name the same rank.
* A message larger than the receive buffer aborts the receiving *process* (``gloo::EnforceNotMet`` in a
  background thread, ``terminate``). Ranks at different points of the protocol would send messages of
  different sizes, so every message starts with a fixed-size frame that announces the exchange's
  sequence number, its name and the body's length; a body (beyond what fits in the frame) is received
  into a buffer of exactly the announced length. A frame from a rank at another point of the protocol is
  reported as :class:`~weightsync_audit.AuditOutOfStepError` on every rank, never a crash.

Opening the audit group is itself collective; before ``new_group`` the ranks meet in the store with the
same deadline, so a rank that never reaches its first audit is named as well.

After any failure the group is marked broken: later audits in this process raise at once instead of
waiting on a channel whose peers are gone or out of step.

Without an initialised process group everything here is a no-op over a world of one, so the engine runs,
and is tested, in one process.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from weightsync_audit.channel.framing import (
    INLINE_BYTES,
    MAGIC,
    MISSING,
    OK,
    OUT_OF_STEP,
    REPLY_WORDS,
    REQ_WORDS,
    RULE_FAILED,
    WHAT_BYTES,
    as_u8,
    compact_rows,
    expand_rows,
    join_parts,
    split_parts,
    used_words,
    what_words,
    words_text,
)
from weightsync_audit.channel.groups import AuditGroup, forget_groups, open_group
from weightsync_audit.channel.verdicts import (
    WaitFailure,
    Who,
    gave_up,
    no_answer,
    out_of_step_error,
    post_verdict,
    verdict_error,
    wait_until,
)
from weightsync_audit.compat import describe_this_rank
from weightsync_audit.errors import AuditPreparationError

__all__ = ["DEFAULT_GRACE_S", "Comm", "Rule", "forget_groups"]

DEFAULT_GRACE_S = 5.0
"""Extra seconds a rank waits for the coordinator's answer beyond ``timeout_s``: the coordinator may
itself spend up to ``timeout_s`` waiting for a late rank before it answers."""

_NO_DEADLINE_S = 30 * 60.0

Rule = Callable[[list[bytes]], bytes]
"""What the coordinator computes from every rank's bytes (in rank order): the answer every rank gets."""


class Comm:
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
        self._group: AuditGroup | None = None
        self._who = Who(self.rank, self.world_size, self.global_ranks, timeout_s)

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
            self._group = open_group(self.global_ranks, self.rank, self._deadline_s(), self.grace_s)
            if self._group.hosts is None:  # once per group, every rank at once: where each rank runs
                group = self._group
                group.hosts = []  # the coordinator keeps them (W short lines); the others hold none

                def keep(parts: list[bytes]) -> bytes:
                    group.hosts = [p.decode("utf-8", "replace") for p in parts]
                    return b""

                self.decide(describe_this_rank().encode(), keep, "where each rank runs")

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

    def audit_pg(self) -> Any:
        """The dedicated gloo process group once opened, else ``None``."""
        return self._group.pg if self._group is not None else None

    def _broken_error(self, group: AuditGroup) -> Exception:
        return group.broken_kind(
            f"weightsync audit: the audit channel is unusable after an earlier failure ({group.broken}); "
            "ranks can no longer be compared in this process group"
        )

    # -- point-to-point with deadlines ---------------------------------------------------------

    def _wait(self, group: AuditGroup, work: Any, buf: Any, deadline: float) -> None:
        wait_until(work, buf, deadline, group.graveyard)

    def _post(self, group: AuditGroup, t: torch.Tensor, peer: int, send: bool) -> Any:
        try:
            if send:
                group.sent_bytes += t.numel() * t.element_size()
                group.sent_messages += 1
                return dist.isend(t, dst=self.global_ranks[peer], group=group.pg)
            return dist.irecv(t, src=self.global_ranks[peer], group=group.pg)
        except Exception as exc:
            raise WaitFailure(False, str(exc)[:200]) from exc

    # -- the round: every rank's bytes to the coordinator, one answer back -------------------------

    def _round(self, payload: bytes | bytearray | memoryview | np.ndarray, rule: Rule, what: str) -> bytes:
        self.setup()
        group = self._group
        assert group is not None
        self._who.timeout_s = self.timeout_s  # a caller may lengthen it for one exchange
        with group.lock:
            pending = None
            if group.broken:
                pending, group.pending = group.pending, None
                if pending is None or self.rank != 0:
                    raise self._broken_error(group)
            seq = group.seq
            group.seq += 1
            body = as_u8(payload)
            if self.rank == 0:
                return self._coordinate(group, seq, body, rule, what, pending)
            return self._participate(group, seq, body, what)

    def _request_frame(self, seq: int, body: torch.Tensor, what: str) -> torch.Tensor:
        what_hash, name_words = what_words(what)
        frame = np.zeros(REQ_WORDS, dtype=np.int64)
        frame[:4] = (MAGIC, seq, what_hash, body.numel())
        frame[4 : 4 + len(name_words)] = name_words
        inline = body.numel() if body.numel() <= INLINE_BYTES else 0
        if inline:
            frame.view(np.uint8)[(4 + len(name_words)) * 8 :][:inline] = body.numpy()
        return torch.from_numpy(frame[: used_words(4 + len(name_words), inline)])

    def _participate(self, group: AuditGroup, seq: int, body: torch.Tensor, what: str) -> bytes:
        deadline = time.monotonic() + self._deadline_s() + self.grace_s
        reply = torch.empty(REPLY_WORDS, dtype=torch.int64)
        try:
            answer = self._post(group, reply, 0, send=False)  # posted first: the answer may come at once
            frame = self._request_frame(seq, body, what)
            self._wait(group, self._post(group, frame, 0, send=True), frame, deadline)
            if body.numel() > INLINE_BYTES:
                self._wait(group, self._post(group, body, 0, send=True), body, deadline)
            self._wait(group, answer, reply, deadline)
            r = reply.numpy()
            if r[0] != MAGIC or r[1] != seq:
                raise WaitFailure(False, "the coordinator answered another exchange")
            status, nbytes = int(r[2]), int(r[3])
            if nbytes <= INLINE_BYTES:
                data = r[4:].view(np.uint8)[:nbytes].tobytes()
            else:
                big = torch.empty(nbytes, dtype=torch.uint8)
                self._wait(group, self._post(group, big, 0, send=False), big, deadline)
                data = big.numpy().tobytes()
        except WaitFailure as failure:
            raise no_answer(self._who, group, seq, what, failure) from None
        if status == OK:
            return data
        verdict = json.loads(data)
        if status == RULE_FAILED:
            raise AuditPreparationError(verdict["error"], {self.global_ranks[0]: verdict["error"]})
        raise verdict_error(self._who, group, verdict, what)

    def _gather_frames(
        self, group: AuditGroup, seq: int, body: torch.Tensor, what: str, skip: frozenset[int]
    ) -> tuple[list[bytes], dict[int, WaitFailure], dict[int, str]]:
        """The coordinator's half of the way up: every rank's bytes, the ranks lost, the ranks elsewhere."""
        w = self.world_size
        deadline = time.monotonic() + self._deadline_s()
        what_hash, _ = what_words(what)
        frames = {r: torch.empty(REQ_WORDS, dtype=torch.int64) for r in range(1, w)}
        works: dict[int, Any] = {}
        failures: dict[int, WaitFailure] = {r: WaitFailure(False, "lost at an earlier exchange") for r in skip}
        for r in range(1, w):
            if r not in failures:
                try:
                    works[r] = self._post(group, frames[r], r, send=False)
                except WaitFailure as f:
                    failures[r] = f
        for r, work in works.items():
            try:
                self._wait(group, work, frames[r], deadline)
            except WaitFailure as f:
                failures[r] = f
        positions: dict[int, str] = {}
        datas: list[bytes] = [body.numpy().tobytes()] + [b""] * (w - 1)
        bodies: dict[int, tuple[Any, torch.Tensor]] = {}
        for r in range(1, w):
            if r in failures:
                continue
            f = frames[r].numpy()
            if f[0] != MAGIC or f[1] != seq or f[2] != what_hash:
                text = words_text(f[4 : 4 + WHAT_BYTES // 8])
                positions[self.global_ranks[r]] = f"at {text or 'an unknown point'} (exchange #{int(f[1])})"
            nbytes = int(f[3])
            if nbytes <= INLINE_BYTES:
                datas[r] = f.view(np.uint8)[(4 + WHAT_BYTES // 8) * 8 :][:nbytes].tobytes()
            else:  # exactly the announced size: a frame from elsewhere in the protocol cannot crash gloo
                big = torch.empty(nbytes, dtype=torch.uint8)
                try:
                    bodies[r] = (self._post(group, big, r, send=False), big)
                except WaitFailure as fail:
                    failures[r] = fail
        body_deadline = max(deadline, time.monotonic() + self.grace_s)
        for r, (work, big) in bodies.items():
            try:
                self._wait(group, work, big, body_deadline)
                datas[r] = big.numpy().tobytes()
            except WaitFailure as fail:
                failures[r] = fail
        return datas, failures, positions

    def _coordinate(
        self,
        group: AuditGroup,
        seq: int,
        body: torch.Tensor,
        rule: Rule,
        what: str,
        pending: tuple[dict[str, Any], frozenset[int]] | None,
    ) -> bytes:
        datas, failures, positions = self._gather_frames(group, seq, body, what, pending[1] if pending else frozenset())
        if pending is not None:
            verdict: dict[str, Any] = pending[0]
        elif failures:
            # Ranks that dropped the connection because they gave up on *this* rank make it the late one.
            late = [r for r, f in failures.items() if not f.timed_out and gave_up(group, seq, r)]
            missing = [self.global_ranks[0]] if late else [self.global_ranks[r] for r in sorted(failures)]
            verdict = {"missing": missing, "what": what}
        elif positions:
            positions[self.global_ranks[0]] = f"at {what} (exchange #{seq})"
            verdict = {"positions": {str(k): v for k, v in positions.items()}}
        else:
            verdict = {}

        status = OK
        if verdict:
            post_verdict(group, seq, verdict)
            status = MISSING if verdict.get("missing") else OUT_OF_STEP
            data = json.dumps(verdict).encode()
        else:
            try:
                data = rule(datas)
            except Exception as exc:  # noqa: BLE001 - every rank raises it alike
                status = RULE_FAILED
                text = f"weightsync audit: the coordinator could not decide {what}: {type(exc).__name__}: {exc}"
                data = json.dumps({"error": text}).encode()
        lost = self._answer(group, seq, status, data, failures)
        if verdict:
            raise verdict_error(self._who, group, verdict, what)
        if lost:
            # Every rank but these has its answer, so it stands for this exchange; the survivors learn at
            # the next one, all naming the same rank(s).
            late = [r for r in lost if gave_up(group, seq, r)]
            missing = [self.global_ranks[0]] if late else [self.global_ranks[r] for r in sorted(lost)]
            verdict = {"missing": missing, "what": what}
            post_verdict(group, seq, verdict)
            group.broken = f"rank(s) {missing} did not take the answer at {what}"
            group.pending = (verdict, frozenset(lost))
        if status == RULE_FAILED:
            error = json.loads(data)["error"]
            raise AuditPreparationError(error, {self.global_ranks[0]: error})
        return data

    def _answer(
        self, group: AuditGroup, seq: int, status: int, data: bytes, failures: dict[int, WaitFailure]
    ) -> list[int]:
        """Send the same answer to every reachable rank at once; the ranks it could not reach."""
        frame = np.zeros(REPLY_WORDS, dtype=np.int64)
        frame[:4] = (MAGIC, seq, status, len(data))
        inline = len(data) if len(data) <= INLINE_BYTES else 0
        if inline:
            frame.view(np.uint8)[32:][:inline] = np.frombuffer(data, dtype=np.uint8)
        reply = torch.from_numpy(frame[: used_words(4, inline)])
        big = as_u8(data) if len(data) > INLINE_BYTES else None
        deadline = time.monotonic() + self.grace_s
        works: dict[int, list[tuple[Any, torch.Tensor]]] = {}
        lost = []
        for r in range(1, self.world_size):
            if r in failures:
                continue
            try:
                works[r] = [(self._post(group, reply, r, send=True), reply)]
                if big is not None:
                    works[r].append((self._post(group, big, r, send=True), big))
            except WaitFailure:
                lost.append(r)
        for r, pairs in works.items():
            try:
                for work, t in pairs:
                    self._wait(group, work, t, deadline)
            except WaitFailure:
                lost.append(r)
        return sorted(lost)

    # -- public exchanges ----------------------------------------------------------------------

    def decide(self, payload: bytes | np.ndarray, rule: Rule, what: str = "the audit") -> bytes:
        """``rule`` of every rank's bytes, computed once by the coordinator, on every rank.

        Every rank must pass the same ``rule`` (a pure function of the list of every rank's bytes, in
        rank order); only the coordinator runs it, so the answer is one message whatever the number of
        ranks. If it raises, every rank raises :class:`~weightsync_audit.AuditPreparationError`.
        """
        if not self.distributed:
            return rule([as_u8(payload).numpy().tobytes()])
        return self._round(payload, rule, what)

    def exchange(self, payload: np.ndarray, what: str = "the audit", compact: bool = False) -> np.ndarray:
        """Every rank's fixed-length int64 vector, as a ``[world, L]`` array, on every rank. ``compact``:
        the same array, but the answer says only each column's majority value and the cells that differ."""
        row = np.ascontiguousarray(payload, dtype=np.int64).reshape(-1)
        if not self.distributed:
            return row.reshape(1, -1).copy()
        if compact:
            table = expand_rows(self._round(row, compact_rows, what), self.world_size)
            if isinstance(table, np.ndarray):
                return table
            lengths = [8 * n for n in table]
        else:
            parts = split_parts(self._round(row, join_parts, what), self.world_size)
            lengths = [len(p) for p in parts]
        if any(n != row.nbytes for n in lengths):
            group = self._group
            assert group is not None
            sizes = {self.global_ranks[r]: f"{n // 8} value(s) at {what}" for r, n in enumerate(lengths)}
            raise out_of_step_error(group, sizes, what)
        return np.frombuffer(b"".join(parts), dtype=np.int64).reshape(self.world_size, row.size).copy()

    def exchange_within(self, payload: np.ndarray, what: str, extra_s: float, compact: bool = False) -> np.ndarray:
        """:meth:`exchange` with its deadline lengthened by ``extra_s`` for this one exchange: the time a
        transfer may still take on other ranks, so that a rank done early does not take a busy peer for a
        missing one."""
        if self.timeout_s is None or extra_s <= 0:
            return self.exchange(payload, what, compact)
        saved = self.timeout_s
        self.timeout_s = saved + extra_s
        try:
            return self.exchange(payload, what, compact)
        finally:
            self.timeout_s = saved

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
