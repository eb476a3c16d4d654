"""When the summaries say the audit cannot go on: a rank failed to prepare it, or the ranks are out of step.

Both are said alike on every rank, after one more round in which each rank tells what it knows (its
error, its position), so that every rank raises the same error naming the same ranks.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from weightsync_audit.channel.framing import LEGACY_INLINE_BYTES
from weightsync_audit.channel.star import Comm
from weightsync_audit.errors import AuditOutOfStepError, AuditPreparationError

__all__ = ["raise_failed", "raise_out_of_step"]


def raise_failed(comm: Comm, failure: BaseException | None) -> None:
    """Every rank's failure message shared; this rank's own error raised, or one naming the ranks that failed."""
    mine = "" if failure is None else f"{type(failure).__name__}: {failure}"
    messages = [b.decode("utf-8", "replace") for b in comm.exchange_bytes(mine.encode(), "the failure report")]
    if failure is not None:
        raise failure
    failed = {comm.global_ranks[r]: m for r, m in enumerate(messages) if m}
    text = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
    raise AuditPreparationError(
        f"weightsync audit could not run because other ranks failed to prepare it: {text}", failed
    )


def raise_out_of_step(comm: Comm, fields: Sequence[str], position: dict[str, Any]) -> None:
    """Every rank's ``position`` (step, epoch, hook, config, slice) shared, and the error naming each."""
    if "protocol" in fields:  # a rank may run the previous release: frames it can read, never abort on
        comm.inline_limit = LEGACY_INLINE_BYTES
    positions = [json.loads(b) for b in comm.exchange_bytes(json.dumps(position).encode(), "the out-of-step report")]
    lines = {}
    for r, p in enumerate(positions):
        where = [f"step {p['step']}", f"epoch {p['epoch']}", f"hook {p['hook']}"]
        if "config" in fields or "protocol" in fields:
            where.append(p["config"])
        if "slice" in fields:
            where.append(f"sample slice {p['slice']} (ranks audited a different number of times)")
        lines[comm.global_ranks[r]] = ", ".join(where)
    text = "; ".join(f"rank {r}: {w}" for r, w in lines.items())
    raise AuditOutOfStepError(
        f"ranks reached the weight audit out of step ({', '.join(fields)} differ), so their weights "
        f"cannot be compared: {text}",
        lines,
    )
