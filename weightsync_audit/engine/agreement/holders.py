"""The replica groups of a tensor held by some ranks by design (a pipeline stage's, an expert's), as a pure
function of what every rank gathered.

A rank holding such a tensor sends its peer key (which hashes its group's global ranks) and, for a group
whose members are known (declared by the user with :func:`~weightsync_audit.declare_replicas`, or read from
the engine: Megatron's ``parallel_state``; an adapter says so with ``among(..., declared=True)``), its members as positions in the
audit. The ranks with equal keys hold the same replicas; the declared members that are not among them
(the tensor is missing there, or declared with another group) belong to the group all the same: their
structure is compared with the holders', as strictly as DDP replicas'. A group of one rank has no replica
and is never compared nor counted in ``checked``.

>>> replica_groups([7, None, 7, 9], [(0, 2), (), (0, 2), (1, 3)])
[([0, 2], [0, 2]), ([3], [1, 3])]
>>> replica_groups([5, 6], [(0,), (1,)])   # one stage per rank: nothing has a replica
[]
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from weightsync_audit.engine.inventory.peers import NEVER, peer_sets

__all__ = ["carriers", "replica_groups"]


def carriers(per_rank: Sequence[Iterable[tuple[int, Sequence[int]]]]) -> dict[int, set[int]]:
    """For the keys of groups found by the audit (members ``[-1]``): the ranks carrying each key on some
    tensor. ``per_rank[r]``: rank r's ``(key, members)`` pairs.

    >>> carriers([[(7, [-1])], [(9, [-1])], [(7, [-1])], [(5, [0, 2])]])
    {7: {0, 2}, 9: {1}}
    """
    out: dict[int, set[int]] = {}
    for r, pairs in enumerate(per_rank):
        for key, members in pairs:
            if list(members) == [-1]:
                out.setdefault(int(key), set()).add(r)
    return out


def replica_groups(
    keys: Sequence[int | None], members: Sequence[Sequence[int]], found: Mapping[int, set[int]] | None = None
) -> list[tuple[list[int], list[int]]]:
    """Each replica group of one tensor as ``(holders, group)``: the ranks holding it with the group's key,
    and those ranks with the group's declared members (positions; none declared: the holders alone).

    ``keys[r]`` is rank r's peer key for the tensor (``None``: it does not hold it), ``members[r]`` the
    members rank r declared for it; members ``[-1]`` (``FOUND``): the ranks ``found[key]`` carrying the key
    on some tensor (:func:`carriers`). Groups of a single rank are left out; lowest rank first."""
    world = len(keys)
    out = []
    for holders in peer_sets([NEVER if k is None else int(k) for k in keys]):
        key = keys[holders[0]]
        if key is None:
            continue
        named = [int(r) for r in members[holders[0]]]
        declared = set((found or {}).get(int(key), ())) if named == [-1] else {r for r in named if 0 <= r < world}
        group = sorted(declared | set(holders))
        if len(group) > 1:
            out.append((holders, group))
    return out
