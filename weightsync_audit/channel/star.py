"""How ranks talk during an audit: a star over a dedicated gloo group, every wait bounded.

Why not ``all_gather``: a collective that a rank never joins blocks the others until the process group's
own timeout (30 minutes by default) and then fails without saying who was missing. Here every message
goes through the group's first rank (the coordinator) with point-to-point sends whose waits carry a
deadline. The coordinator knows exactly which ranks arrived and tells the others, so every rank raises
:class:`~weightsync_audit.AuditTimeoutError` naming the same missing ranks. A dedicated gloo group keeps
these small CPU messages apart from the training traffic (which may be NCCL) and gives per-call timeouts.

What gloo does on failure shapes the protocol (measured with torch 2.13):

* A ``wait(timeout)`` that expires closes *every* pair of that process's gloo context ("Application
  timeout caused pair closure"), so after waiting out a late rank the coordinator can no longer answer
  the punctual ones over gloo. The verdict therefore also goes through the job's key-value store (the
  one ``init_process_group`` set up), under a key per exchange; a rank whose gloo reply fails reads it
  there. Only failures touch the store: a healthy exchange is one gloo message up and one down per rank.
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
from datetime import timedelta
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from weightsync_audit.channel.framing import (
    INLINE_BYTES,
    MAGIC,
    MISSING,
    OK,
    OUT_OF_STEP,
    REQ_WORDS,
    WHAT_BYTES,
    as_u8,
    split_parts,
    what_words,
    words_text,
)
from weightsync_audit.channel.groups import AuditGroup, forget_groups, open_group
from weightsync_audit.compat import is_timeout_text
from weightsync_audit.errors import AuditOutOfStepError, AuditTimeoutError

__all__ = ["DEFAULT_GRACE_S", "Comm", "forget_groups"]

DEFAULT_GRACE_S = 5.0
"""Extra seconds a rank waits for the coordinator's answer beyond ``timeout_s``: the coordinator may
itself spend up to ``timeout_s`` waiting for a late rank before it answers."""

_NO_DEADLINE_S = 30 * 60.0
_STORE_WAIT_S = 2.0
"""How long a rank whose gloo reply failed looks for the coordinator's verdict in the store."""


class WaitFailure(Exception):
    """A wait failed: ``timed_out`` (the deadline passed) or the peer closed the connection."""

    def __init__(self, timed_out: bool, why: str) -> None:
        self.timed_out = timed_out
        super().__init__(why)


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
        self._group: AuditGroup | None = None

    # -- set-up --------------------------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def _deadline_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else _NO_DEADLINE_S

    def setup(self) -> None:
        """Create the dedicated audit group now (collective over the group's ranks, with the deadline)."""
        if self.distributed and self._group is None:
            self._group = open_group(self.global_ranks, self.rank, self._deadline_s(), self.grace_s)

    def audit_pg(self) -> Any:
        """The dedicated gloo process group once opened, else ``None``."""
        return self._group.pg if self._group is not None else None

    def _pg(self) -> AuditGroup:
        self.setup()
        assert self._group is not None
        if self._group.broken:
            raise self._group.broken_kind(
                f"weightsync audit: the audit channel is unusable after an earlier failure ({self._group.broken}); "
                "ranks can no longer be compared in this process group"
            )
        return self._group

    # -- point-to-point with deadlines ---------------------------------------------------------

    def _wait(self, group: AuditGroup, work: Any, buf: Any, deadline: float) -> None:
        # Never wait "0 s": a message that has already arrived must still count as arrived, and gloo
        # returns a completed receive even after a timeout has closed the context's pairs.
        left = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timeout=timedelta(seconds=left))
        except Exception as exc:
            group.graveyard.append((work, buf))
            text = str(exc)
            timed_out = is_timeout_text(text)
            raise WaitFailure(
                timed_out, text.strip().splitlines()[-1][:200] if text.strip() else type(exc).__name__
            ) from exc

    def _send(self, group: AuditGroup, t: torch.Tensor, dst: int, deadline: float) -> None:
        try:
            work = dist.isend(t, dst=self.global_ranks[dst], group=group.pg)
        except Exception as exc:
            raise WaitFailure(False, str(exc)[:200]) from exc
        self._wait(group, work, t, deadline)

    def _recv(self, group: AuditGroup, t: torch.Tensor, src: int, deadline: float) -> None:
        try:
            work = dist.irecv(t, src=self.global_ranks[src], group=group.pg)
        except Exception as exc:
            raise WaitFailure(False, str(exc)[:200]) from exc
        self._wait(group, work, t, deadline)

    # -- failure verdicts ----------------------------------------------------------------------

    def _limit(self) -> str:
        return f"within {self.timeout_s:g}s" if self.timeout_s is not None else "before the deadline"

    def _timeout_error(
        self, group: AuditGroup, missing_global: Sequence[int], what: str, why: str = ""
    ) -> AuditTimeoutError:
        missing_global = sorted(set(missing_global))
        me = self.global_ranks[self.rank]
        group.broken = f"rank(s) {missing_global} did not arrive at {what}"
        group.broken_kind = AuditTimeoutError
        if not why:
            why = (
                "this rank arrived after the others had given up waiting for it"
                if me in missing_global
                else "a rank is stuck, dead, or auditing at a different point"
            )
        return AuditTimeoutError(
            f"weightsync audit: rank(s) {missing_global} did not arrive at {what} {self._limit()} "
            f"(this is rank {me} of {self.world_size}); {why}",
            missing_global,
        )

    def _out_of_step_error(self, group: AuditGroup, positions: dict[int, str], what: str) -> AuditOutOfStepError:
        group.broken = f"ranks were at different points of the audit protocol at {what}"
        group.broken_kind = AuditOutOfStepError
        text = "; ".join(f"rank {r}: {p}" for r, p in sorted(positions.items()))
        return AuditOutOfStepError(
            "weightsync audit: ranks are at different points of the audit protocol (one audits while another "
            f"resyncs, or one audited more often than the others), so nothing was compared: {text}",
            positions,
        )

    def _verdict_error(self, group: AuditGroup, verdict: dict[str, Any], what: str) -> Exception:
        if verdict.get("missing"):
            return self._timeout_error(group, verdict["missing"], verdict.get("what", what))
        positions = {int(r): p for r, p in verdict.get("positions", {}).items()}
        return self._out_of_step_error(group, positions, what)

    def _post_verdict(self, group: AuditGroup, seq: int, verdict: dict[str, Any]) -> None:
        try:
            group.store.set(f"verdict/{seq}", json.dumps(verdict))
        except Exception:  # noqa: BLE001 - the store may be gone with its host; the gloo reply may still work
            pass

    def _read_verdict(self, group: AuditGroup, seq: int, wait_s: float) -> dict[str, Any] | None:
        try:
            group.store.wait([f"verdict/{seq}"], timedelta(seconds=wait_s))
            return json.loads(group.store.get(f"verdict/{seq}"))
        except Exception:  # noqa: BLE001 - no verdict: the coordinator did not decide (stuck or dead)
            return None

    def _no_answer(self, group: AuditGroup, seq: int, what: str, failure: WaitFailure) -> Exception:
        """A non-coordinator lost contact with the coordinator: the store may say why, else blame it."""
        if failure.timed_out:
            # Say so before anything else: a coordinator that turns up late and finds this rank's
            # connection closed must learn that it was the late one, not this rank.
            try:
                group.store.set(f"gave_up/{seq}/{self.rank}", "1")
            except Exception:  # noqa: BLE001
                pass
        # A closed connection means the coordinator decided (its verdict follows within moments) or died;
        # after a plain timeout a verdict is unlikely, so only look.
        verdict = self._read_verdict(group, seq, 0.2 if failure.timed_out else _STORE_WAIT_S)
        if verdict is not None:
            return self._verdict_error(group, verdict, what)
        how = "did not answer in time" if failure.timed_out else "closed the connection"
        return self._timeout_error(
            group,
            [self.global_ranks[0]],
            what,
            f"the coordinator (rank {self.global_ranks[0]}) {how}; it is stuck, dead, or auditing at a different point",
        )

    # -- the star exchange ---------------------------------------------------------------------

    def _gather(self, payload: bytes | bytearray | memoryview | np.ndarray, what: str) -> list[bytes]:
        """Every rank's bytes on every rank, through the coordinator, every wait bounded."""
        group = self._pg()
        with group.lock:
            seq = group.seq
            group.seq += 1
            body = as_u8(payload)
            if self.rank == 0:
                return self._coordinate(group, seq, body, what)
            return self._participate(group, seq, body, what)

    def _request_frame(self, seq: int, body: torch.Tensor, what: str) -> torch.Tensor:
        what_hash, name_words = what_words(what)
        frame = np.zeros(REQ_WORDS, dtype=np.int64)
        frame[:4] = (MAGIC, seq, what_hash, body.numel())
        frame[4 : 4 + len(name_words)] = name_words
        if body.numel() <= INLINE_BYTES:
            frame.view(np.uint8)[(4 + len(name_words)) * 8 :][: body.numel()] = body.numpy()
        return torch.from_numpy(frame)

    def _reply_words(self) -> tuple[int, int]:
        # Room for the whole phase-(a) table inline (64 bytes a rank, plus the 8-byte length of each rank's
        # part that precedes the table): a healthy audit is one message each way.
        inline = max(INLINE_BYTES, 72 * self.world_size)
        return 4 + self.world_size, inline

    def _participate(self, group: AuditGroup, seq: int, body: torch.Tensor, what: str) -> list[bytes]:
        deadline = time.monotonic() + self._deadline_s() + self.grace_s
        head, inline = self._reply_words()
        reply = torch.empty(head + inline // 8, dtype=torch.int64)
        try:
            self._send(group, self._request_frame(seq, body, what), 0, deadline)
            if body.numel() > INLINE_BYTES:
                self._send(group, body, 0, deadline)
            self._recv(group, reply, 0, deadline)
            r = reply.numpy()
            if r[0] != MAGIC or r[1] != seq:
                raise WaitFailure(False, "the coordinator answered another exchange")
            status, nbytes, codes = int(r[2]), int(r[3]), r[4:head]
            if nbytes <= inline:
                data = r[head:].view(np.uint8)[:nbytes].tobytes()
            else:
                big = torch.empty(nbytes, dtype=torch.uint8)
                self._recv(group, big, 0, deadline)
                data = big.numpy().tobytes()
        except WaitFailure as failure:
            raise self._no_answer(group, seq, what, failure) from None
        if status != OK:
            verdict = json.loads(data)
            if not verdict.get("missing") and status == MISSING:
                verdict["missing"] = [self.global_ranks[i] for i in np.nonzero(codes == MISSING)[0].tolist()]
            raise self._verdict_error(group, verdict, what)
        return split_parts(data, self.world_size)

    def _coordinate(self, group: AuditGroup, seq: int, body: torch.Tensor, what: str) -> list[bytes]:
        w = self.world_size
        deadline = time.monotonic() + self._deadline_s()
        what_hash, _ = what_words(what)
        frames = [torch.empty(REQ_WORDS, dtype=torch.int64) for _ in range(w)]
        works: list[Any] = [None] * w
        failures: dict[int, WaitFailure] = {}
        for r in range(1, w):
            try:
                works[r] = dist.irecv(frames[r], src=self.global_ranks[r], group=group.pg)
            except Exception as exc:  # noqa: BLE001
                failures[r] = WaitFailure(False, str(exc)[:200])
        for r in range(1, w):
            if r in failures:
                continue
            try:
                self._wait(group, works[r], frames[r], deadline)
            except WaitFailure as f:
                failures[r] = f
        positions: dict[int, str] = {}
        datas: list[bytes] = [body.numpy().tobytes()] + [b""] * (w - 1)
        for r in range(1, w):
            if r in failures:
                continue
            f = frames[r].numpy()
            text = words_text(f[4 : 4 + WHAT_BYTES // 8])
            if f[0] != MAGIC or f[1] != seq or f[2] != what_hash:
                positions[self.global_ranks[r]] = f"at {text or 'an unknown point'} (exchange #{int(f[1])})"
            nbytes = int(f[3])
            if nbytes <= INLINE_BYTES:
                datas[r] = f.view(np.uint8)[(4 + WHAT_BYTES // 8) * 8 :][:nbytes].tobytes()
            else:  # exactly the announced size: a frame from elsewhere in the protocol cannot crash gloo
                big = torch.empty(nbytes, dtype=torch.uint8)
                try:
                    self._recv(group, big, r, max(deadline, time.monotonic() + self.grace_s))
                    datas[r] = big.numpy().tobytes()
                except WaitFailure as fail:
                    failures[r] = fail

        if failures:
            # Ranks that dropped the connection because they gave up on *this* rank make it the late one.
            gave_up = [r for r, f in failures.items() if not f.timed_out and self._gave_up(group, seq, r)]
            missing = [self.global_ranks[0]] if gave_up else [self.global_ranks[r] for r in sorted(failures)]
            verdict: dict[str, Any] = {"missing": missing, "what": what}
        elif positions:
            positions[self.global_ranks[0]] = f"at {what} (exchange #{seq})"
            verdict = {"positions": {str(k): v for k, v in positions.items()}}
        else:
            verdict = {}

        send_deadline = time.monotonic() + self.grace_s
        head, inline = self._reply_words()
        if verdict:
            self._post_verdict(group, seq, verdict)
            status = MISSING if verdict.get("missing") else OUT_OF_STEP
            data = json.dumps(verdict).encode()
        else:
            status = OK
            lengths = np.array([len(d) for d in datas], dtype=np.int64)
            data = lengths.tobytes() + b"".join(datas)
        frame = np.zeros(head + inline // 8, dtype=np.int64)
        frame[:4] = (MAGIC, seq, status, len(data))
        for r in failures:
            frame[4 + r] = MISSING
        for r in range(1, w):
            if self.global_ranks[r] in positions:
                frame[4 + r] = OUT_OF_STEP
        if len(data) <= inline:
            frame.view(np.uint8)[head * 8 :][: len(data)] = np.frombuffer(data, dtype=np.uint8)
        reply = torch.from_numpy(frame)
        big = as_u8(data) if len(data) > inline else None
        for r in range(1, w):
            if r in failures:
                continue
            try:
                self._send(group, reply, r, send_deadline)
                if big is not None:
                    self._send(group, big, r, send_deadline)
            except WaitFailure as fail:
                if verdict:
                    continue  # they read the verdict from the store
                failures[r] = fail
        if failures and not verdict:
            # Every rank arrived but one could not be answered: it learns this from the store.
            verdict = {"missing": [self.global_ranks[r] for r in sorted(failures)], "what": what}
            self._post_verdict(group, seq, verdict)
        if verdict:
            raise self._verdict_error(group, verdict, what)
        return datas

    def _gave_up(self, group: AuditGroup, seq: int, r: int) -> bool:
        # The peer closes its connection just before it writes the marker: allow it a moment.
        try:
            group.store.wait([f"gave_up/{seq}/{r}"], timedelta(seconds=0.5))
            return True
        except Exception:  # noqa: BLE001 - no marker: the peer died or never came
            return False

    # -- public exchanges ----------------------------------------------------------------------

    def exchange(self, payload: np.ndarray, what: str = "the audit") -> np.ndarray:
        """Every rank's fixed-length int64 vector, as a ``[world, L]`` array, on every rank."""
        row = np.ascontiguousarray(payload, dtype=np.int64).reshape(-1)
        if not self.distributed:
            return row.reshape(1, -1).copy()
        parts = self._gather(row, what)
        if any(len(p) != row.nbytes for p in parts):
            group = self._group
            assert group is not None
            sizes = {self.global_ranks[r]: f"{len(p) // 8} value(s) at {what}" for r, p in enumerate(parts)}
            raise self._out_of_step_error(group, sizes, what)
        return np.frombuffer(b"".join(parts), dtype=np.int64).reshape(self.world_size, row.size).copy()

    def exchange_bytes(self, payload: bytes, what: str = "the audit") -> list[bytes]:
        """Every rank's byte string, of any length, on every rank."""
        if not self.distributed:
            return [bytes(payload)]
        return self._gather(payload, what)

    def share_bytes(self, src: int, payload: bytes | None, what: str = "the audit") -> bytes:
        """Rank ``src``'s bytes on every rank (the others pass ``None``)."""
        data = payload if self.rank == src else b""
        return self.exchange_bytes(data or b"", what)[src]
