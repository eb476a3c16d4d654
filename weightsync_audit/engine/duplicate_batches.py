"""Duplicate batches: data-parallel ranks that trained on identical batches at a step.

Off by default (``check_batches=True`` on ``LoopAudit`` or the Lightning callback turns it on,
``AuditConfig.check_batches``). At an
audited step every rank digests its own batch (xxh3-64 over every tensor's exact bytes, in order, with
dtype and shape) into its auditor's :class:`BatchRecords`; the audit that covers the step, synchronous or
overlapped, takes that digest into its context and one round of the audit channel gathers them: ranks
whose digests are equal trained on the same samples, which silently divides the effective data by the
number of ranks sharing it (a sampler without ``rank=``, a resume that restored rank 0's shard on every
rank). The same finding on every rank, from the same data.

>>> import torch
>>> from weightsync_audit.channel.star import Comm
>>> shared_batches(Comm(None, 60.0), batch_digest({"x": torch.ones(2)}))  # one rank: nothing to compare
[]
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.checkpoints.sidecar import flat_tensors
from weightsync_audit.engine.hashing.digest import digest_tensors
from weightsync_audit.errors import warn_user

__all__ = ["BatchRecords", "batch_digest", "describe", "shared_batches"]


def batch_digest(batch: Any) -> str | None:
    """16 hex digits over every tensor of ``batch`` (any nesting), or ``None`` when it holds no tensor."""
    flat = flat_tensors(batch)
    if not flat:
        return None
    host = [t.detach() if t.device.type == "cpu" else t.detach().cpu() for t in flat.values()]
    digests = digest_tensors(host, method="xxh3").tolist()  # the audit's own digest: threaded, no copy
    h = xxhash.xxh3_64()
    for (name, t), d in zip(flat.items(), digests):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:{int(d)};".encode())
    return f"{h.intdigest():016x}"


class BatchRecords:
    """This rank's batch digests, one per audited step, owned by its auditor: the audit that covers a step
    consumes that step's digest (and drops any older one), and a confirmed repair clears them."""

    def __init__(self) -> None:
        self.by_step: dict[int, str | None] = {}
        self.said: set[tuple[tuple[int, ...], ...]] = set()
        """Groupings already warned about (once each, on the group's first rank)."""

    def record(self, step: int, batch: Any) -> None:
        """Digest ``batch``, the one trained at ``step`` (local, no message)."""
        self.by_step[int(step)] = batch_digest(batch)

    def take(self, step: int | None) -> str | None:
        """The digest recorded for ``step`` (None: none), consumed with every older one."""
        if step is None:
            return None
        digest = self.by_step.pop(int(step), None)
        for old in [s for s in self.by_step if s < step]:
            del self.by_step[old]
        return digest

    def clear(self) -> None:
        """Forget every digest (a repair made the replicas equal: what came before is no one's evidence)."""
        self.by_step.clear()

    def warn_new(self, groups: list[list[int]], step: int) -> None:
        """Warn once per grouping (call it on one rank)."""
        key = tuple(tuple(g) for g in groups)
        if key not in self.said:
            self.said.add(key)
            warn_user(f"weightsync: {describe(groups, step)}")


def shared_batches(comm: Comm, digest: str | None) -> list[list[int]]:
    """The groups of ranks (global, each of two or more) whose batch digests are equal; collective over
    ``comm`` (one round) when it has more than one rank, the same on every rank."""
    if comm.world_size < 2:
        return []
    digests = [json.loads(p) for p in comm.exchange_bytes(json.dumps(digest).encode(), "the batch digests")]
    by: dict[str, list[int]] = {}
    for g, d in zip(comm.global_ranks, digests):
        if d is not None:
            by.setdefault(d, []).append(g)
    return sorted(sorted(rs) for rs in by.values() if len(rs) > 1)


def describe(groups: list[list[int]], step: int) -> str:
    """One line: ``ranks 0, 1 trained on identical batches at step 4 (...)``.

    >>> describe([[0, 1]], 4)
    'ranks 0, 1 trained on identical batches at step 4: the effective data is divided by 2 there (a sampler without rank=, or one shard restored on every rank?)'
    """
    parts = "; ".join("ranks " + ", ".join(map(str, g)) for g in groups)
    most = max(len(g) for g in groups)
    return (
        f"{parts} trained on identical batches at step {step}: the effective data is divided by {most} there "
        "(a sampler without rank=, or one shard restored on every rank?)"
    )
