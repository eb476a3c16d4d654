"""Failure verdicts of the audit channel: who was missing or out of step, said alike on every rank.

A failure verdict is a small JSON object, ``{"missing": [global ranks], "what": ...}`` or
``{"positions": {global rank: where}}``. The coordinator decides it and sends it over gloo; it also
writes it into the job's store (bounded calls), where a rank whose gloo reply failed reads it. Once a
rank has raised, its group is marked broken and later exchanges raise at once.

What gloo does on failure shapes the protocol (measured with torch 2.13):

* A ``wait(timeout)`` that expires closes *every* pair of that process's gloo context ("Application
  timeout caused pair closure"), so after waiting out a late rank the coordinator can no longer answer
  the punctual ones over gloo. The verdict therefore also goes through the job's key-value store (the
  one ``init_process_group`` set up), under a key per exchange; a rank whose gloo reply fails reads it
  there. Only failures touch the store: a healthy exchange is one gloo message up and one down per rank.
  Every store call is bounded (:mod:`~weightsync_audit.channel.groups`): a stopped store host
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
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, Sequence

from weightsync_audit.channel.groups import AuditGroup, late_why
from weightsync_audit.compat import is_timeout_text
from weightsync_audit.errors import AuditOutOfStepError, AuditTimeoutError

__all__ = [
    "GAVE_UP_WAIT_S",
    "STORE_WAIT_S",
    "WaitFailure",
    "Who",
    "gave_up",
    "no_answer",
    "out_of_step_error",
    "post_verdict",
    "timeout_error",
    "verdict_error",
]

STORE_WAIT_S = 2.0
"""How long a rank whose gloo reply failed (closed connection) looks for the coordinator's verdict."""

GAVE_UP_WAIT_S = 0.5
"""How long the coordinator looks for a peer's 'gave up on you' marker after its connection closed."""

_STORE_SLACK_S = 0.5
"""Beyond its own wait, how long a store call may take before the store counts as unreachable."""


class WaitFailure(Exception):
    """A wait failed: ``timed_out`` (the deadline passed) or the peer closed the connection."""

    def __init__(self, timed_out: bool, why: str) -> None:
        self.timed_out = timed_out
        super().__init__(why)


def wait_until(work: Any, buf: Any, deadline: float, graveyard: list[Any]) -> None:
    """Wait for a gloo operation until ``deadline`` (``time.monotonic()``); :class:`WaitFailure` when it fails.

    Never waits "0 s": a message that has already arrived must still count as arrived, and gloo returns a
    completed receive even after a timeout has closed the context's pairs. The buffer of a failed
    operation goes to ``graveyard``: gloo may still write into it.
    """
    left = max(deadline - time.monotonic(), 0.001)
    try:
        work.wait(timedelta(seconds=left))
    except Exception as exc:
        graveyard.append((work, buf))
        text = str(exc)
        raise WaitFailure(
            is_timeout_text(text), text.strip().splitlines()[-1][:200] if text.strip() else type(exc).__name__
        ) from exc


class Who:
    """What a verdict needs to know of the rank that raises it."""

    __slots__ = ("global_ranks", "rank", "timeout_s", "world_size")

    def __init__(self, rank: int, world_size: int, global_ranks: tuple[int, ...], timeout_s: float | None) -> None:
        self.rank, self.world_size, self.global_ranks, self.timeout_s = rank, world_size, global_ranks, timeout_s

    def limit(self) -> str:
        return f"within {self.timeout_s:g}s" if self.timeout_s is not None else "before the deadline"


def timeout_error(
    who: Who, group: AuditGroup, missing_global: Sequence[int], what: str, why: str = ""
) -> AuditTimeoutError:
    missing_global = sorted(set(missing_global))
    me = who.global_ranks[who.rank]
    group.broken = f"rank(s) {missing_global} did not arrive at {what}"
    group.broken_kind = AuditTimeoutError
    return AuditTimeoutError(
        f"weightsync audit: rank(s) {missing_global} did not arrive at {what} {who.limit()} "
        f"(this is rank {me} of {who.world_size}); {why or late_why(me, missing_global)}",
        missing_global,
    )


def out_of_step_error(group: AuditGroup, positions: dict[int, str], what: str) -> AuditOutOfStepError:
    group.broken = f"ranks were at different points of the audit protocol at {what}"
    group.broken_kind = AuditOutOfStepError
    text = "; ".join(f"rank {r}: {p}" for r, p in sorted(positions.items()))
    return AuditOutOfStepError(
        "weightsync audit: ranks are at different points of the audit protocol (one audits while another "
        f"resyncs, or one audited more often than the others), so nothing was compared: {text}",
        positions,
    )


def verdict_error(who: Who, group: AuditGroup, verdict: dict[str, Any], what: str) -> Exception:
    if verdict.get("missing"):
        return timeout_error(who, group, verdict["missing"], verdict.get("what", what))
    positions = {int(r): p for r, p in verdict.get("positions", {}).items()}
    return out_of_step_error(group, positions, what)


def post_verdict(group: AuditGroup, seq: int, verdict: dict[str, Any]) -> None:
    # Best effort: the store may be gone with its host; the gloo reply may still work.
    group.store.set(f"verdict/{seq}", json.dumps(verdict), _STORE_SLACK_S + 1.5)


def read_verdict(group: AuditGroup, seq: int, wait_s: float) -> dict[str, Any] | None:
    raw = group.store.wait_get(f"verdict/{seq}", wait_s, wait_s + _STORE_SLACK_S)
    return json.loads(raw) if raw is not None else None


def gave_up(group: AuditGroup, seq: int, r: int) -> bool:
    """Whether group rank ``r`` wrote that it gave up waiting on the coordinator at exchange ``seq``."""
    # The peer closes its connection just before it writes the marker: allow it a moment.
    return group.store.wait_get(f"gave_up/{seq}/{r}", GAVE_UP_WAIT_S, GAVE_UP_WAIT_S + _STORE_SLACK_S) is not None


def no_answer(
    who: Who, group: AuditGroup, seq: int, what: str, failure: WaitFailure, peer: int = 0, wait_s: float | None = None
) -> tuple[dict[str, Any], Exception]:
    """A rank lost contact with the rank it reports to (``peer``: the coordinator, or its host's leader):
    the verdict the store holds (looked for ``wait_s``), else one that blames ``peer``; and its error."""
    if failure.timed_out:
        # Say so before anything else: a coordinator that turns up late and finds this rank's
        # connection closed must learn that it was the late one, not this rank.
        group.store.set(f"gave_up/{seq}/{who.rank}", "1", _STORE_SLACK_S)
    # A closed connection means the coordinator decided (its verdict follows within moments) or died;
    # after a plain timeout a verdict is unlikely, so only look.
    verdict = read_verdict(group, seq, wait_s if wait_s is not None else 0.2 if failure.timed_out else STORE_WAIT_S)
    if verdict is not None:
        return verdict, verdict_error(who, group, verdict, what)
    how = "did not answer in time" if failure.timed_out else "closed the connection"
    blamed = who.global_ranks[peer]
    role = "the coordinator" if peer == 0 else "its host's leader"
    why = f"{role} (rank {blamed}) {how}; it is stuck, dead, or auditing at a different point"
    return {"missing": [blamed], "what": what}, timeout_error(who, group, [blamed], what, why)
