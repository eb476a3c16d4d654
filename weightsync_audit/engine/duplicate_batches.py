"""Duplicate batches: data-parallel ranks that trained on identical batches at a step.

Off by default (``LoopAudit(check_batches=True)`` turns it on). At an audited step every rank digests its
own batch (xxh3-64 over every tensor's exact bytes, in order, with dtype and shape), and one round of the
audit channel gathers the 8-byte digests: ranks whose digests are equal trained on the same samples, which
silently divides the effective data by the number of ranks sharing it (a sampler without ``rank=``, a
resume that restored rank 0's shard on every rank). The same finding on every rank, from the same data.

>>> import torch
>>> from weightsync_audit.channel.star import Comm
>>> check = DuplicateBatches()
>>> check(Comm(None, 60.0), {"x": torch.ones(2)}, step=3) is None  # one rank: nothing to compare
True
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import xxhash

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.checkpoints.sidecar import flat_tensors
from weightsync_audit.engine.hashing.digest import digest_tensors
from weightsync_audit.errors import WeightSyncWarning

__all__ = ["DuplicateBatches", "batch_digest"]


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


class DuplicateBatches:
    """The check, callable at a step on every rank of a group (collective when it has more than one rank)."""

    def __init__(self) -> None:
        self.said: set[tuple[tuple[int, ...], ...]] = set()

    def __call__(self, comm: Comm, batch: Any, *, step: int, is_main: bool = False) -> dict[str, Any] | None:
        """``{"step", "groups": [[ranks trained on one batch], ...]}`` when some ranks shared a batch, else
        ``None``. Warns on the main process when a new grouping appears."""
        if comm.world_size < 2:
            return None
        mine = json.dumps(batch_digest(batch)).encode()
        digests = [json.loads(p) for p in comm.exchange_bytes(mine, "the batch digests")]
        by: dict[str, list[int]] = {}
        for g, d in zip(comm.global_ranks, digests):
            if d is not None:
                by.setdefault(d, []).append(g)
        groups = sorted(sorted(rs) for rs in by.values() if len(rs) > 1)
        if not groups:
            return None
        key = tuple(tuple(g) for g in groups)
        if is_main and key not in self.said:
            self.said.add(key)
            warnings.warn(f"weightsync: {describe(groups, step)}", WeightSyncWarning, stacklevel=3)
        return {"step": step, "groups": groups}


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
