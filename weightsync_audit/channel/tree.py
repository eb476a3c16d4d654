"""The audit channel as a tree: each host's ranks through their leader, the leaders through the coordinator.

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

import torch

from weightsync_audit.channel.groups import AuditGroup
from weightsync_audit.channel.verdicts import STORE_WAIT_S, WaitFailure, no_answer
from weightsync_audit.channel.wire import MISSING, OUT_OF_STEP, StarWire, as_u8, join_parts, split_parts

__all__ = ["DEFAULT_FAN_IN", "FAN_IN_ENV", "RANKS_PER_HOST_ENV", "TreeWire", "block_size"]

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

    def _relay(self, group: AuditGroup, seq: int, body: torch.Tensor, what: str) -> bytes:
        k = group.block
        if k and self.rank % k == 0:
            return self._lead(group, seq, body, what)
        return self._participate(group, seq, body, what, self.rank - self.rank % k if k else 0)

    def _lead(self, group: AuditGroup, seq: int, body: torch.Tensor, what: str) -> bytes:
        start = time.monotonic()
        children = self._children(self.rank)
        skip, group.pending = (group.pending[1] if group.pending else frozenset()), None
        got, failures, positions = self._gather_frames(group, seq, what, skip, children, start + self._deadline_s())
        missing = self._missing(group, seq, failures, self.rank) if failures else []
        report = json.dumps({"missing": missing, "positions": {str(r): p for r, p in positions.items()}})
        if missing or positions:
            up = _REPORT + report.encode()
        else:
            up = _PARTS + join_parts([body.numpy().tobytes()] + [got[c] for c in children])
        deadline = start + self._deadline_s() + self.grace_s
        try:
            if any(f.timed_out for f in failures.values()):
                group.store.set(f"block/{seq}/{self.rank}", report)
                raise WaitFailure(False, "this leader's connections closed when it waited out a rank")
            status, data = self._ask(group, seq, as_u8(up), what, 0, deadline)
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
