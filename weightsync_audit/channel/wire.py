"""The star's wire: one round of :class:`~weightsync_audit.channel.star.Comm`, every rank's bytes up to the
coordinator and one answer back, each wait bounded by a deadline.

:class:`StarWire` holds the point-to-point half of ``Comm`` (framing, the coordinator's gathering and
answering, the failure verdicts); ``Comm`` adds the set-up and the public exchanges on top. Why a star
and what gloo's failures make of it: :mod:`~weightsync_audit.channel.star`.

Framing: a message larger than the receive buffer aborts the receiving *process* in gloo, and ranks at
different points of the protocol would send messages of different sizes; so every message starts with a
frame of ``REQ_WORDS`` int64 words (magic, exchange number, hash and text of the exchange's name, body
length, and up to ``INLINE_BYTES`` of the body); a longer body is received into a buffer of exactly the
announced length. The reply is framed alike in ``REPLY_WORDS`` words (magic, exchange number, status, body
length, inline body), whatever the number of ranks. Frames are received into buffers of the largest
frame's size and sent at their own length (:func:`used_words`): an exchange of up to a kilobyte each way
is one message up and one down (each gloo message brings its own handshake: about 500 bytes on loopback).
"""

from __future__ import annotations

import functools
import json
import struct
import time
from typing import Any, Callable

import numpy as np
import torch
import xxhash

from weightsync_audit.channel.groups import AuditGroup
from weightsync_audit.channel.verdicts import (
    STORE_WAIT_S,
    WaitFailure,
    Who,
    gave_up,
    no_answer,
    post_verdict,
    verdict_error,
    wait_until,
)
from weightsync_audit.errors import AuditPreparationError

__all__ = [
    "LEGACY_INLINE_BYTES",
    "REQ_WORDS",
    "Rule",
    "StarWire",
    "as_bytes",
    "compact_rows",
    "expand_rows",
    "join_parts",
    "split_parts",
]

MAGIC = 0x5753_4146  # 'WSAF'
WHAT_BYTES = 48
INLINE_BYTES = 1024
LEGACY_INLINE_BYTES = 128
"""What a frame of the previous release carried inline; a longer body came as a message of its own."""
INLINE_FLAG = 1 << 62
"""Set in a frame's length word when a body longer than ``LEGACY_INLINE_BYTES`` rides the frame, so that a
frame of the previous release (no flag, a body over 128 bytes sent apart) is still read right."""
REQ_WORDS = 4 + WHAT_BYTES // 8 + INLINE_BYTES // 8  # magic, seq, what hash, nbytes, what, inline
REPLY_WORDS = 4 + INLINE_BYTES // 8  # magic, seq, status, nbytes, inline

OK, MISSING, OUT_OF_STEP, RULE_FAILED = 0, 1, 2, 3


HEADER = struct.Struct("=4q")  # a frame's first four int64 words, in this machine's order
_NAME = slice(32, 32 + WHAT_BYTES)
_ZERO = bytes(8)


@functools.lru_cache(maxsize=512)
def what_words(what: str) -> tuple[int, bytes]:
    """An exchange's name as the frame carries it: its hash and its first ``WHAT_BYTES`` (zero-padded; the
    names are few and fixed, so they are said once)."""
    raw = what.encode("utf-8", "replace")
    return xxhash.xxh3_64_intdigest(raw) >> 1, raw[:WHAT_BYTES].ljust(WHAT_BYTES, b"\0")


def length_word(nbytes: int, inline: bool) -> int:
    """A frame's length word: the body's length, flagged when it rides the frame beyond what the previous
    release carried inline."""
    return nbytes | (INLINE_FLAG if inline and nbytes > LEGACY_INLINE_BYTES else 0)


def read_length(word: int) -> tuple[int, bool]:
    """(the body's length, whether it rides the frame) from a frame's length word."""
    nbytes = word & ~INLINE_FLAG
    return nbytes, bool(word & INLINE_FLAG) or nbytes <= LEGACY_INLINE_BYTES


def used_words(header_words: int, inline_bytes: int) -> int:
    """The words of a frame actually sent: its header and the inline body, rounded up to a word.

    A receive buffer may be larger than the message that fills it (gloo delivers a shorter message
    whole; only a longer one aborts the process), so every frame is received into a buffer of the
    largest frame's size and sent at its own length: a short exchange costs its own bytes only.
    """
    return header_words + -(-inline_bytes // 8)


def as_bytes(data: bytes | bytearray | memoryview | np.ndarray) -> bytes:
    """A message's bytes (an array's in C order)."""
    return data.tobytes() if isinstance(data, np.ndarray) else bytes(data)


def join_parts(parts: list[bytes]) -> bytes:
    """Every rank's bytes in one message: their lengths (int64 each), then the bytes in rank order."""
    return np.array([len(p) for p in parts], dtype=np.int64).tobytes() + b"".join(parts)


def split_parts(data: bytes, world: int) -> list[bytes]:
    ends = np.cumsum(np.frombuffer(data[: 8 * world], dtype=np.int64)).tolist()
    return [data[8 * world + a : 8 * world + b] for a, b in zip([0, *ends], ends)]


def compact_rows(parts: list[bytes]) -> bytes:
    """Every rank's int64 row, said compactly: per column the value most ranks hold (the column's
    median, which is any strict majority's value), then only the cells that differ from it (flat index,
    value). What comes back grows with what differs, not with the number of ranks. Rows of unequal
    lengths come back as ``[-1, length of each]`` so that every rank can name the ranks out of step."""
    sizes = [len(p) // 8 for p in parts]
    if len(set(sizes)) != 1 or any(len(p) % 8 for p in parts):
        return np.array([-1, *sizes], dtype=np.int64).tobytes()
    table = np.frombuffer(b"".join(parts), dtype=np.int64).reshape(len(parts), sizes[0])
    base = np.sort(table, axis=0)[len(parts) // 2] if table.size else np.zeros(sizes[0], dtype=np.int64)
    flat = np.flatnonzero(table != base)
    return np.concatenate([[sizes[0]], base, flat, table.reshape(-1)[flat]]).astype(np.int64).tobytes()


def expand_rows(data: bytes, world: int) -> np.ndarray | list[int]:
    """The ``[world, L]`` table that :func:`compact_rows` said; the rows' lengths when they differed."""
    words = np.frombuffer(data, dtype=np.int64)
    if words[0] < 0:
        return words[1:].tolist()
    n = int(words[0])
    base, rest = words[1 : 1 + n], words[1 + n :]
    table = np.array(np.tile(base, (world, 1)))  # writable even when empty (np.tile then hands back a view)
    k = rest.size // 2
    table.reshape(-1)[rest[:k]] = rest[k:]
    return table


Rule = Callable[[list[bytes]], bytes]
"""What the coordinator computes from every rank's bytes (in rank order): the answer every rank gets."""


class StarWire:
    """The round itself; :class:`~weightsync_audit.channel.star.Comm` supplies the group and the set-up."""

    rank: int
    world_size: int
    global_ranks: tuple[int, ...]
    timeout_s: float | None
    grace_s: float
    _group: AuditGroup | None
    _who: Who
    inline_limit: int = INLINE_BYTES
    """The longest body a frame carries: ``LEGACY_INLINE_BYTES`` once a rank may run the previous release
    (its receive buffers hold 208-byte frames), so that it reads an error instead of aborting."""

    def setup(self) -> None:  # pragma: no cover - Comm's
        raise NotImplementedError

    def post(self, pg: Any, t: torch.Tensor, peer: int, send: bool) -> Any:  # pragma: no cover - Comm's
        raise NotImplementedError

    def _deadline_s(self) -> float:  # pragma: no cover - Comm's
        raise NotImplementedError

    def _broken_error(self, group: AuditGroup) -> Exception:  # pragma: no cover - Comm's
        raise NotImplementedError

    # -- point-to-point with deadlines ---------------------------------------------------------

    def _wait(self, group: AuditGroup, work: Any, buf: Any, deadline: float) -> None:
        try:
            wait_until(work, buf, deadline, group.graveyard)
        except WaitFailure:
            group.drop_buffers()  # gloo may still use a buffer of a failed operation: none is reused
            raise

    def _post(self, group: AuditGroup, t: torch.Tensor, peer: int, send: bool) -> Any:
        try:
            if send:
                group.sent_bytes += t.numel() * t.element_size()
                group.sent_messages += 1
            return self.post(group.pg, t, peer, send)
        except Exception as exc:
            raise WaitFailure(False, str(exc)[:200]) from exc

    # -- the layout: who sends to whom (a star unless the group's ``block`` makes it a tree) ----------

    @property
    def _block(self) -> int:
        """Ranks per block: the tree's (:attr:`AuditGroup.block`), or the whole group for a star."""
        return (self._group.block if self._group is not None else 0) or self.world_size

    def _children(self, p: int) -> list[int]:
        """The positions that send their bytes to position ``p`` and take its answer: the rest of its
        block, and for the coordinator also the other blocks' leaders (:class:`~weightsync_audit.channel.star.TreeWire`)."""
        w, k = self.world_size, self._block
        return list(range(p + 1, min(p - p % k + k, w))) + (list(range(k, w, k)) if p == 0 else [])

    def _subtree(self, c: int) -> list[int]:
        """The positions whose bytes the message of the coordinator's child ``c`` carries."""
        k = self._block
        return list(range(c, min(c + k, self.world_size))) if c % k == 0 else [c]

    def _unfold(self, c: int, body: bytes, datas: list[bytes], missing: list[int], positions: dict[int, str]) -> None:
        """Child ``c``'s bytes into ``datas`` (a leader's into its block's slots, or what it reports)."""
        datas[c] = body

    def _recover(self, group: AuditGroup, seq: int, failures: dict[int, WaitFailure], missing: list[int]) -> None:
        """(A tree's) what a leader that lost its connections left in the store instead."""

    def _relay(self, group: AuditGroup, seq: int, body: bytes, what: str) -> bytes:
        """A non-coordinator's part of the round."""
        return self._participate(group, seq, body, what)

    def _missing(self, group: AuditGroup, seq: int, failures: dict[int, WaitFailure], me: int) -> list[int]:
        """The global ranks lost with the children that failed, or ``me`` alone when one of them dropped its
        connection because it gave up on ``me`` (then ``me`` was the late one)."""
        if any(not f.timed_out and gave_up(group, seq, c) for c, f in failures.items()):
            return [self.global_ranks[me]]
        return [self.global_ranks[p] for c in sorted(failures) for p in self._subtree(c)]

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
            body = as_bytes(payload)
            try:
                if self.rank == 0:
                    return self._coordinate(group, seq, body, rule, what, pending)
                return self._relay(group, seq, body, what)
            except BaseException:
                group.drop_buffers()  # an operation may still be pending on a kept buffer
                raise

    def _request_frame(self, group: AuditGroup, seq: int, body: bytes, what: str) -> torch.Tensor:
        what_hash, name = what_words(what)
        inline = len(body) if len(body) <= self.inline_limit else 0
        n = used_words(_NAME.stop // 8, inline)
        frame, t = group.frame(("request", n), n)
        HEADER.pack_into(frame, 0, MAGIC, seq, what_hash, length_word(len(body), inline > 0))
        frame[_NAME] = name
        if inline:
            frame[8 * n - 8 :] = _ZERO  # the last word's bytes past the body stay zero
            frame[_NAME.stop : _NAME.stop + inline] = body
        return t

    def _participate(self, group: AuditGroup, seq: int, body: bytes, what: str, peer: int = 0) -> bytes:
        deadline = time.monotonic() + self._deadline_s() + self.grace_s
        try:
            status, data = self._ask(group, seq, body, what, peer, deadline)
        except WaitFailure as failure:
            # Under a leader, the coordinator's verdict may come after the leader's connection closed.
            wait = max(deadline - time.monotonic(), 0.0) + STORE_WAIT_S if peer else None
            raise no_answer(self._who, group, seq, what, failure, peer, wait)[1] from None
        return self._settle(group, status, data, what)

    def _ask(
        self, group: AuditGroup, seq: int, body: bytes, what: str, peer: int, deadline: float
    ) -> tuple[int, bytes]:
        """Send this rank's bytes to ``peer`` and take its answer: ``(status, data)``, or :class:`WaitFailure`."""
        r, reply = group.frame("reply", REPLY_WORDS)
        answer = self._post(group, reply, peer, send=False)  # posted first: the answer may come at once
        frame = self._request_frame(group, seq, body, what)
        self._wait(group, self._post(group, frame, peer, send=True), frame, deadline)
        if len(body) > self.inline_limit:
            big = torch.frombuffer(bytearray(body), dtype=torch.uint8)
            self._wait(group, self._post(group, big, peer, send=True), big, deadline)
        self._wait(group, answer, reply, deadline)
        magic, got, status, word = HEADER.unpack_from(r)
        if magic != MAGIC or got != seq:
            raise WaitFailure(False, "the coordinator answered another exchange")
        nbytes, inline = read_length(word)
        if inline:
            return status, bytes(r[32 : 32 + nbytes])
        big = torch.empty(nbytes, dtype=torch.uint8)
        self._wait(group, self._post(group, big, peer, send=False), big, deadline)
        return status, big.numpy().tobytes()

    def _settle(self, group: AuditGroup, status: int, data: bytes, what: str) -> bytes:
        """The answer's data, or the error it says."""
        if status == OK:
            return data
        verdict = json.loads(data)
        if status == RULE_FAILED:
            raise AuditPreparationError(verdict["error"], {self.global_ranks[0]: verdict["error"]})
        raise verdict_error(self._who, group, verdict, what)

    def _gather_frames(
        self, group: AuditGroup, seq: int, what: str, skip: frozenset[int], children: list[int], deadline: float
    ) -> tuple[dict[int, bytes], dict[int, WaitFailure], dict[int, str]]:
        """The way up: each child's bytes (those in step), the children lost, the ranks elsewhere."""
        what_hash, _ = what_words(what)
        frames = {r: group.frame(("frame", r), REQ_WORDS) for r in children}
        works: dict[int, Any] = {}
        failures: dict[int, WaitFailure] = {r: WaitFailure(False, "lost at an earlier exchange") for r in skip}
        for r in children:
            if r not in failures:
                try:  # the receive posted when the audit started (Comm.prime), else one posted now
                    primed = group.primed.pop(r, None)
                    works[r] = primed if primed is not None else self._post(group, frames[r][1], r, send=False)
                except WaitFailure as f:
                    failures[r] = f
        for r, work in works.items():
            try:
                self._wait(group, work, frames[r][1], deadline)
            except WaitFailure as f:
                failures[r] = f
        positions: dict[int, str] = {}
        datas: dict[int, bytes] = {}
        bodies: dict[int, tuple[Any, torch.Tensor]] = {}
        for r in children:
            if r in failures:
                continue
            f = frames[r][0]
            magic, got, named, word = HEADER.unpack_from(f)
            if magic != MAGIC or got != seq or named != what_hash:
                text = bytes(f[_NAME]).rstrip(b"\0").decode("utf-8", "replace")
                positions[self.global_ranks[r]] = f"at {text or 'an unknown point'} (exchange #{got})"
            nbytes, inline = read_length(word)
            if inline:
                datas[r] = bytes(f[_NAME.stop : _NAME.stop + nbytes])
            else:  # exactly the announced size: a frame from elsewhere in the protocol cannot crash gloo
                big = torch.empty(nbytes, dtype=torch.uint8)
                try:
                    bodies[r] = (self._post(group, big, r, send=False), big)
                except WaitFailure as fail:
                    failures[r] = fail
        body_deadline = max(deadline, time.monotonic() + self.grace_s) if bodies else deadline
        for r, (work, big) in bodies.items():
            try:
                self._wait(group, work, big, body_deadline)
                datas[r] = big.numpy().tobytes()
            except WaitFailure as fail:
                failures[r] = fail
        if positions:  # the bytes of a rank elsewhere in the protocol are not this exchange's
            datas = {r: d for r, d in datas.items() if self.global_ranks[r] not in positions}
        return datas, failures, positions

    def _coordinate(
        self,
        group: AuditGroup,
        seq: int,
        body: bytes,
        rule: Rule,
        what: str,
        pending: tuple[dict[str, Any], frozenset[int]] | None,
    ) -> bytes:
        children = self._children(0)
        # A tree's leaders first wait out their own late ranks, so that those are the ones named.
        deadline = time.monotonic() + self._deadline_s() + (self.grace_s / 2 if group.block else 0.0)
        skip = pending[1] if pending else frozenset()
        got, failures, positions = self._gather_frames(group, seq, what, skip, children, deadline)
        datas, missing = [body] + [b""] * (self.world_size - 1), []
        for c, data in got.items():
            self._unfold(c, data, datas, missing, positions)
        self._recover(group, seq, failures, missing)
        if pending is not None:
            verdict: dict[str, Any] = pending[0]
        elif failures or missing:
            verdict = {"missing": sorted(set(missing + self._missing(group, seq, failures, 0))), "what": what}
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
        lost = self._answer(group, seq, status, data, failures, children)
        if verdict:
            raise verdict_error(self._who, group, verdict, what)
        if lost:
            # Every rank but these has its answer, so it stands for this exchange; the survivors learn at
            # the next one, all naming the same rank(s).
            missing = self._missing(group, seq, {r: WaitFailure(False, "") for r in lost}, 0)
            verdict = {"missing": missing, "what": what}
            post_verdict(group, seq, verdict)
            if missing == [self.global_ranks[0]] and set(lost) | set(failures) >= set(children):
                raise verdict_error(self._who, group, verdict, what)  # none took it: all gave up on this one
            group.broken = f"rank(s) {missing} did not take the answer at {what}"
            group.pending = (verdict, frozenset(lost))
        return self._settle(group, status, data, what)

    def _answer(
        self,
        group: AuditGroup,
        seq: int,
        status: int,
        data: bytes,
        failures: dict[int, WaitFailure],
        children: list[int],
    ) -> list[int]:
        """Send the same answer to every reachable child at once; the children it could not reach."""
        inline = len(data) if len(data) <= self.inline_limit else 0
        n = used_words(4, inline)
        frame, reply = group.frame(("answer", n), n)
        HEADER.pack_into(frame, 0, MAGIC, seq, status, length_word(len(data), inline > 0))
        if inline:
            frame[8 * n - 8 :] = _ZERO  # the last word's bytes past the answer stay zero
            frame[32 : 32 + inline] = data
        big = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) > self.inline_limit else None
        deadline = time.monotonic() + self.grace_s
        works: dict[int, list[tuple[Any, torch.Tensor]]] = {}
        lost = []
        for r in children:
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
