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

__all__ = ["attribute", "attribute_audit", "explained_pairs", "settle_watch"]


def attribute(
    comm: Comm,
    watch: StepWatch | None,
    mismatches: Sequence[Any],
    *,
    prepared: PreparedManifest,
    digests: np.ndarray,
    full: bool,
    ongoing: bool = False,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The blame of a divergence, and where each blamed rank runs; collective when a watch is on (every rank
    calls it, from the same record); ``ongoing``: a divergence decided earlier persists (its difference is
    no evidence about this one)."""
    if watch is None:
        return vote_blame(mismatches), {}
    mine = watch.payload()
    mine["audit_rest"] = watch.changed_since_mark(prepared, digests) if full else []
    mine["audit_rest_evidence"] = watch.audit_evidence if full else []
    mine["host"] = describe_this_rank()
    gathered = [json.loads(b) for b in comm.exchange_bytes(json.dumps(mine).encode(), "the attribution records")]
    ranks = list(comm.global_ranks)
    blame = decide(gathered, ranks, mismatches, [p.get("audit_rest", []) for p in gathered], ongoing=ongoing)
    hosts = {str(r): str(p.get("host", "")) for r, p in zip(ranks, gathered) if r in blame["ranks"]}
    return blame, hosts


def settle_watch(watch: StepWatch | None, *, in_sync: bool, full: bool) -> None:
    """After an audit: an in-sync full audit empties the records."""
    if watch is not None and in_sync:
        watch.found = None
        if full:
            watch.in_sync()


def explained_pairs(mismatches: Sequence[Any]) -> frozenset[tuple[str, int]]:
    """The (tensor, rank) pairs a blame explains: each differing tensor with the ranks outside its reference
    (on a tie, every rank involved: which side is the reference is not evidence)."""
    return frozenset(
        (m.name, r) for m in mismatches for r in (*m.ranks, *(m.reference_ranks if getattr(m, "tie", False) else ()))
    )


def attribute_audit(
    watch: StepWatch | None,
    comm: Comm,
    mismatches: Sequence[Any],
    *,
    prepared: PreparedManifest,
    digests: np.ndarray,
    full: bool,
    hosts: dict[str, str] | None,
    hints: list[str],
) -> tuple[dict[str, Any] | None, dict[str, str] | None, list[str]]:
    """A finished audit's blame (None when in sync: the watch is emptied), with its ``hosts`` and ``hints``:
    with a watch, the blame's hint first and the blamed ranks' hosts added (collective as :func:`attribute`).

    A blame lives as long as its evidence explains the mismatches: every divergent audit exchanges the records
    taken since the last one; a rank they name decides afresh, and so does a (tensor, rank) pair the kept blame
    did not explain (a second fault while a tolerated or unrepaired divergence persists: its own records, else
    the vote)."""
    if not mismatches:
        settle_watch(watch, in_sync=True, full=full)
        return None, hosts, hints
    pairs = explained_pairs(mismatches)
    kept = watch.found if watch is not None else None
    blame, where = attribute(comm, watch, mismatches, prepared=prepared, digests=digests, full=full,
                             ongoing=kept is not None)  # fmt: skip
    named = bool(blame["ranks"]) and blame["evidence"] != "vote"
    if kept is not None and not named and pairs <= kept[2]:  # the same divergence, still explained by its evidence
        blame, where, pairs = kept
    if watch is not None:  # its records reported (a resync after it is no change at rest)
        watch.found = blame, where, pairs
        watch.records.clear()
    if where:
        hosts = {**(hosts or {}), **where}
    if watch is not None and blame["detail"]:  # without a watch the vote is said already
        hints = [blame_hint(blame, hosts), *hints]
    return dict(blame), hosts, hints
