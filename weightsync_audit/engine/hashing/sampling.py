"""What a sampled audit reads: disjoint slices of every large tensor that cover it in ``slices`` audits.

Sampled audits (``slices > 1``) hash slice ``i`` of every tensor larger than ``SMALL`` bytes: the run of
flat elements ``[bound(i), bound(i + 1))``, bounds rounded to ``SAMPLE_ALIGN`` elements. Slices are
disjoint and cover every element, so ``slices`` consecutive audits see the whole model.
"""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["SAMPLE_ALIGN", "SMALL", "sample_bounds", "sample_pieces"]

SMALL = 64 << 10
"""Tensors up to this many bytes are hashed whole in every audit, also in sampled mode: hashing them
costs about as much as the bookkeeping of a slice, and whole small tensors (biases, norms, optimizer
scalars) are then never stale."""

SAMPLE_ALIGN = 64
"""Slice bounds are multiples of this many elements, so every slice starts on a 64-byte boundary (the
device method can then read it as 64-bit words without a copy)."""


def sample_bounds(numel: int, slice_index: int, slices: int) -> tuple[int, int]:
    """Flat element range ``[start, stop)`` of slice ``slice_index`` of ``slices`` of a tensor.

    >>> [sample_bounds(1000, i, 4) for i in range(4)]
    [(0, 192), (192, 448), (448, 704), (704, 1000)]
    """
    i = slice_index % slices

    def bound(k: int) -> int:
        return numel if k >= slices else (k * numel // slices) // SAMPLE_ALIGN * SAMPLE_ALIGN

    return bound(i), bound(i + 1)


def _range_pieces(t: torch.Tensor, start: int, stop: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` whose logical concatenation is ``t.flatten()[start:stop]``, without copying."""
    if start >= stop:
        return
    if t.is_contiguous():
        yield t.reshape(-1)[start:stop]
        return
    if t.dim() == 1:
        yield t[start:stop]
        return
    row = t[0].numel()
    r0, r1 = start // row, stop // row
    if r0 == r1:
        yield from _range_pieces(t[r0], start - r0 * row, stop - r0 * row)
        return
    if start % row:
        yield from _range_pieces(t[r0], start % row, row)
        r0 += 1
    if r1 > r0:
        yield t[r0:r1]
    if stop % row:
        yield from _range_pieces(t[r1], 0, stop % row)


def sample_pieces(t: torch.Tensor, slice_index: int = 0, slices: int = 1) -> list[torch.Tensor]:
    """The views of ``t`` that sampled audit ``slice_index`` of ``slices`` hashes, in logical order.

    Whole for ``slices == 1`` and for tensors up to ``SMALL`` bytes.

    >>> import torch
    >>> [p.tolist() for p in sample_pieces(torch.arange(20000), 1, 2)]  # doctest: +ELLIPSIS
    [[9984, 9985, ...]]
    """
    if slices <= 1 or t.dim() == 0 or t.nbytes <= SMALL:
        return [t]
    start, stop = sample_bounds(t.numel(), slice_index, slices)
    return list(_range_pieces(t, start, stop)) or [t.new_empty(0)]  # with many slices, some are empty
