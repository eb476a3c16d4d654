"""Resync of sharded tensors (DTensors): each shard is copied from a peer that holds it.

A shard can only come from a rank holding the same shard (its peer set, see
:mod:`weightsync_audit.engine.inventory.peers`). In each peer set the source is ``src`` when ``src`` belongs to
it, else the rank holding the set's reference (majority) value, a tie going to the lowest rank. Only
ranks whose digest differs from their source's receive anything. Copies travel point to point on the
audit's gloo group, in one order that every rank derives from the same gathered table, so each
send meets its receive and no rank waits on a transfer that another rank skips.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.agreement.consensus import majority_within
from weightsync_audit.engine.hashing.digest import digest_entries
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.engine.inventory.peers import column_peers

__all__ = ["plan_shard_copies", "resync_shards"]


def plan_shard_copies(digests: np.ndarray, peers: np.ndarray, src: int) -> list[tuple[int, int, int]]:
    """The copies that make every peer set agree: ``(column, from_rank, to_rank)``, in a fixed order.

    ``digests`` and ``peers`` are the gathered ``[world, n]`` tables; ranks are positions in the group.

    >>> d = np.array([[5], [6], [5], [7]]); k = np.array([[2], [3], [2], [3]])
    >>> plan_shard_copies(d, k, src=0)   # set {0, 2} agrees; set {1, 3} ties: rank 1 is its source
    [(0, 1, 3)]
    """
    digests, peers = np.asarray(digests), np.asarray(peers)
    world = digests.shape[0]
    out = []
    for j in range(digests.shape[1]):
        column = digests[:, j].tolist()
        for members in column_peers(peers, j, world):
            if len(members) < 2:
                continue
            source = src if src in members else majority_within(column, members)[0][0]
            out.extend((j, source, r) for r in members if r != source and column[r] != column[source])
    return out


def resync_shards(comm: Comm, entries: Sequence[Entry], src: int) -> None:
    """Copy each diverged shard of ``entries`` (all DTensors, same structure everywhere) from its source.

    Collective over ``comm``'s ranks.
    """
    digests = digest_entries(entries)
    keys = np.array([e.shard.key if e.shard is not None else 0 for e in entries], dtype=np.int64)
    both = comm.exchange(np.concatenate([np.asarray(digests, dtype=np.int64), keys]), "the resync shard digests")
    n = len(entries)
    plan = plan_shard_copies(both[:, :n], both[:, n:], src)
    if not plan:
        return
    comm.setup()
    pg = comm.audit_pg()
    g = comm.global_ranks
    for j, source, target in plan:
        if comm.rank not in (source, target):
            continue
        local = entries[j].tensor
        buf = local.detach().to("cpu", copy=True).contiguous()
        if comm.rank == source:
            dist.send(buf, dst=g[target], group=pg)
        else:
            dist.recv(buf, src=g[source], group=pg)
            with torch.no_grad():
                local.copy_(buf.view_as(local))
