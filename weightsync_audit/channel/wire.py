"""The star's wire: one round of :class:`~weightsync_audit.channel.star.Comm`, every rank's bytes up to the
coordinator and one answer back, each wait bounded by a deadline.

:class:`StarWire` holds the point-to-point half of ``Comm`` (framing, the coordinator's gathering and
answering, the failure verdicts); ``Comm`` adds the set-up and the public exchanges on top. Why a star
and what gloo's failures make of it: :mod:`~weightsync_audit.channel.star`.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import numpy as np
import torch

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
    length_word,
    read_length,
    used_words,
    what_words,
    words_text,
)
from weightsync_audit.channel.groups import AuditGroup
from weightsync_audit.channel.verdicts import (
    WaitFailure,
    Who,
    gave_up,
    no_answer,
    post_verdict,
    verdict_error,
    wait_until,
)
from weightsync_audit.errors import AuditPreparationError

__all__ = ["Rule", "StarWire"]

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
        wait_until(work, buf, deadline, group.graveyard)

    def _post(self, group: AuditGroup, t: torch.Tensor, peer: int, send: bool) -> Any:
        try:
            if send:
                group.sent_bytes += t.numel() * t.element_size()
                group.sent_messages += 1
            return self.post(group.pg, t, peer, send)
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
        inline = body.numel() if body.numel() <= self.inline_limit else 0
        frame[:4] = (MAGIC, seq, what_hash, length_word(body.numel(), inline > 0))
        frame[4 : 4 + len(name_words)] = name_words
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
            if body.numel() > self.inline_limit:
                self._wait(group, self._post(group, body, 0, send=True), body, deadline)
            self._wait(group, answer, reply, deadline)
            r = reply.numpy()
            if r[0] != MAGIC or r[1] != seq:
                raise WaitFailure(False, "the coordinator answered another exchange")
            status, (nbytes, inline) = int(r[2]), read_length(int(r[3]))
            if inline:
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
            nbytes, inline = read_length(int(f[3]))
            if inline:
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
        inline = len(data) if len(data) <= self.inline_limit else 0
        frame[:4] = (MAGIC, seq, status, length_word(len(data), inline > 0))
        if inline:
            frame.view(np.uint8)[32:][:inline] = np.frombuffer(data, dtype=np.uint8)
        reply = torch.from_numpy(frame[: used_words(4, inline)])
        big = as_u8(data) if len(data) > self.inline_limit else None
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
