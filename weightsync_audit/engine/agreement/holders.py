"""The replica groups of a tensor held by some ranks by design (a pipeline stage's, an expert's), as a pure
function of what every rank gathered.

A rank holding such a tensor sends its peer key (which hashes its group's global ranks) and, for a group
the user declared (:func:`~weightsync_audit.declare_replicas`), the group's members as positions in the
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

from typing import Sequence

from weightsync_audit.engine.inventory.peers import NEVER, peer_sets

__all__ = ["replica_groups"]


def replica_groups(keys: Sequence[int | None], members: Sequence[Sequence[int]]) -> list[tuple[list[int], list[int]]]:
    """Each replica group of one tensor as ``(holders, group)``: the ranks holding it with the group's key,
    and those ranks with the group's declared members (positions; none declared: the holders alone).

    ``keys[r]`` is rank r's peer key for the tensor (``None``: it does not hold it), ``members[r]`` the
    members rank r declared for it. Groups of a single rank are left out; lowest rank first."""
    world = len(keys)
    out = []
    for holders in peer_sets([NEVER if k is None else int(k) for k in keys]):
        if keys[holders[0]] is None:
            continue
        declared = {int(r) for r in members[holders[0]] if 0 <= int(r) < world}
        group = sorted(declared | set(holders))
        if len(group) > 1:
            out.append((holders, group))
    return out
