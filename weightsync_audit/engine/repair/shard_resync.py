"""Resync of sharded tensors (DTensors): each shard is copied from a peer that holds it.

A shard can only come from a rank holding the same shard (its peer set, see
:mod:`weightsync_audit.engine.inventory.peers`). In each peer set the source is ``src`` when ``src`` belongs to
it, else the rank holding the set's reference (majority) value, a tie going to the lowest rank. Only
ranks whose digest differs from their source's receive anything. Copies travel over the data plane
(:func:`~weightsync_audit.engine.repair.resync_transfer.move_copies`): in chunks, written in place (no
host copy of a whole shard), every wait bounded by a deadline that grows with the bytes, in one order
that every rank derives from the same gathered table, so each send meets its receive and no rank waits
on a transfer that another rank skips.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.agreement.consensus import majority_within
from weightsync_audit.engine.hashing.digest import digest_entries
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.engine.inventory.peers import column_peers
from weightsync_audit.engine.repair.resync_transfer import move_copies

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
    # One copy per (shard, source) to all of its diverged peers, over the data plane: chunked, written in
    # place, every wait bounded; a failure is agreed on and raised as ResyncError on every rank.
    targets: dict[tuple[int, int], list[int]] = {}
    for j, source, target in plan:
        targets.setdefault((j, source), []).append(target)
    move_copies(
        comm, src, [(entries[j].name, entries[j].tensor, source, dsts) for (j, source), dsts in targets.items()]
    )
