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

import json
from typing import Any, Callable, Sequence

import numpy as np
import torch

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.agreement.consensus import majority_within
from weightsync_audit.engine.hashing.digest import digest_entries
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.engine.inventory.peers import NEVER, column_peers, peer_sets
from weightsync_audit.engine.repair.resync_transfer import Copy, move_copies
from weightsync_audit.text import fmt_ranks

__all__ = ["plan_held_copies", "plan_shard_copies", "resync_shards"]


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


def _held_rows(entries: Sequence[Entry]) -> list[list[Any]]:
    digests = digest_entries(entries).tolist() if entries else []
    return [
        [e.uid, int(e.shard.key) if e.shard is not None else NEVER, e.dtype, list(e.tensor.shape), int(d),
         int(e.container is not None and not isinstance(e.container[e.key], torch.Tensor))]
        for e, d in zip(entries, digests)
    ]  # fmt: skip


def plan_held_copies(comm: Comm, entries: Sequence[Entry], src: int, is_check: Callable[[str], bool]) -> list[Copy]:
    """The copies that make the holders of each tensor held by some ranks only agree (collective).

    ``entries``: this rank's tensors compared among their holders (an engine's ``holders:`` layouts: a
    scalar ``step`` of an FSDP1-sharded parameter, an FSDP1 hybrid shard, a check such as
    ``fsdp1.optimizer_state_held``); another rank may hold others. Every rank gathers every rank's
    (name, peer key, dtype, local shape, digest) and derives the same plan: within each set of ranks holding
    a tensor under one key, from ``src`` when it is one of them, else from the set's majority holder, to the
    holders whose digest differs. Raises ``ValueError`` on every rank alike, before anything moves, when
    holders disagree in dtype or shape, when a differing one is a Python value (never copied between
    some ranks), or when a check (``is_check``) differs: what it checks has no replica to copy from.
    A rank that holds no tensor of a copy passes a ``meta`` stand-in of the source's size (never written).
    """
    rows = _held_rows(entries)
    gathered = [json.loads(b) for b in comm.exchange_bytes(json.dumps(rows).encode(), "the resync held tensors")]
    per_rank: list[dict[str, tuple[Any, ...]]] = [{r[0]: tuple(r[1:]) for r in rows_r} for rows_r in gathered]
    order = list(dict.fromkeys(uid for rows_r in gathered for uid, *_ in rows_r))
    mine = {e.uid: e for e in entries}
    g = comm.global_ranks
    problems: list[str] = []
    copies: list[Copy] = []
    for uid in order:
        name = uid.split(":", 1)[1]
        keys = [d[uid][0] if uid in d else NEVER for d in per_rank]
        for members in peer_sets(keys):
            if len(members) < 2:
                continue
            sigs = {(per_rank[r][uid][1], tuple(per_rank[r][uid][2])) for r in members}
            if len(sigs) > 1:
                problems.append(
                    f"{name} differs in dtype or shape among its holders {fmt_ranks([g[r] for r in members])}"
                )
                continue
            column = [per_rank[r][uid][3] if r in members else 0 for r in range(comm.world_size)]
            source = src if src in members else majority_within(column, members)[0][0]
            dsts = [r for r in members if column[r] != column[source]]
            if not dsts:
                continue
            if is_check(name):
                problems.append(
                    f"{name} differs on {fmt_ranks([g[r] for r in dsts])} from rank {g[source]}: what it checks "
                    "(optimizer state of a shard) has no replica to copy from; restore it from a checkpoint"
                )
            elif per_rank[source][uid][4]:
                problems.append(f"{name} is a Python value held by some ranks only: it is not copied")
            else:
                e = mine.get(uid)
                dtype, shape = per_rank[source][uid][1], per_rank[source][uid][2]
                t = e.tensor if e is not None else torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
                copies.append((name, t, source, dsts))
    if problems:
        raise ValueError(f"cannot resync (nothing was changed): {'; '.join(problems[:5])}" + (
            f" and {len(problems) - 5} more" if len(problems) > 5 else ""))  # fmt: skip
    return copies
