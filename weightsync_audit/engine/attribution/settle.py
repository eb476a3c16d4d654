"""At an audit: the blame for a divergence (collective, off the healthy path), and the watch kept in step.

On a divergent audit every rank sends its step records (one message, JSON) and every rank decides the
same blame from the same gathered records (:func:`~.blame.decide`). Without a watch the vote alone
decides, with no message. An in-sync full audit empties the records: nothing before it is in doubt.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from weightsync_audit.channel.star import Comm
from weightsync_audit.compat import describe_this_rank
from weightsync_audit.engine.attribution.blame import blame_hint, decide, vote_blame
from weightsync_audit.engine.attribution.watch import StepWatch
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest

__all__ = ["attribute", "blame_hint", "settle_watch"]


def attribute(
    comm: Comm,
    watch: StepWatch | None,
    mismatches: Sequence[Any],
    *,
    prepared: PreparedManifest,
    digests: np.ndarray,
    full: bool,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The blame of a divergence, and where each blamed rank runs; collective when a watch is on (every rank
    calls it, from the same record)."""
    if watch is None:
        return vote_blame(mismatches), {}
    mine = watch.payload()
    mine["audit_rest"] = watch.changed_since_mark(prepared, digests) if full else []
    mine["host"] = describe_this_rank()
    gathered = [json.loads(b) for b in comm.exchange_bytes(json.dumps(mine).encode(), "the attribution records")]
    ranks = list(comm.global_ranks)
    blame = decide(gathered, ranks, mismatches, [p.get("audit_rest", []) for p in gathered])
    hosts = {str(r): str(p.get("host", "")) for r, p in zip(ranks, gathered) if r in blame["ranks"]}
    return blame, hosts


def settle_watch(watch: StepWatch | None, *, in_sync: bool, full: bool) -> None:
    """After an audit: an in-sync full audit empties the records."""
    if watch is not None and in_sync and full:
        watch.in_sync()
