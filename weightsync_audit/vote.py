"""The vote: which value of a tensor is the reference, and which ranks hold another.

A leaf module (it imports nothing of the package), so every layer that must decide the same way, the
engine's consensus and DDP's re-wrap agreement among them, uses this one rule.
"""

from __future__ import annotations

from typing import Hashable, Sequence

__all__ = ["majority"]


def majority(values: Sequence[Hashable]) -> tuple[list[int], list[int]]:
    """Split ranks into (reference ranks, differing ranks).

    The reference group is the largest group of equal values; a tie goes to the group holding the
    lowest rank.

    >>> majority([5, 5, 7, 5])
    ([0, 1, 3], [2])
    >>> majority([1, 2])
    ([0], [1])
    """
    groups: dict[Hashable, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    best = min(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))
    ref = set(best)
    return best, [r for r in range(len(values)) if r not in ref]
