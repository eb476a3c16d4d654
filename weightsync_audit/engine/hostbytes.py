"""How tensors are read as host bytes: zero-copy views that keep their owner alive, and bounded copies.

Every byte the engine reads from a tensor comes through here, so no code holds a raw pointer into a
temporary: a view is a ``memoryview`` over a NumPy array whose base is the tensor itself, so the tensor
lives as long as the view does, and an accelerator or non-contiguous tensor is first copied into a
host tensor that the returned object owns.
"""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["CHUNK", "contiguous_blocks", "host_bytes", "host_view"]

CHUNK = 8 << 20
"""Bytes per leaf of the xxh3 tree hash, and the bound on any temporary copy of a non-contiguous tensor."""


def host_view(t: torch.Tensor) -> memoryview:
    """The logical bytes of ``t`` as a ``memoryview`` that keeps its memory alive.

    Zero-copy for a contiguous CPU tensor (any dtype, bf16 and float8 included); any other tensor
    (on an accelerator, non-contiguous, conjugated) is copied to a host tensor that the view owns.

    >>> import torch
    >>> bytes(host_view(torch.tensor([1, 2], dtype=torch.int16)))
    b'\\x01\\x00\\x02\\x00'
    """
    t = t.detach()
    if t.numel() == 0:
        return memoryview(b"")
    if not t.is_cpu or t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg().to("cpu")
    flat = t.contiguous().reshape(-1)
    if flat.stride(0) != 1:  # one element with an odd stride counts as contiguous, but cannot change dtype
        flat = flat.as_strided((1,), (1,))
    # .numpy() makes an array whose base holds the tensor: the memory stays valid while the view lives.
    return memoryview(flat.view(torch.uint8).numpy())


def host_bytes(t: torch.Tensor) -> bytes:
    """An owned ``bytes`` copy of the logical bytes of ``t``, from any device and layout."""
    return bytes(host_view(t))


def contiguous_blocks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Contiguous pieces of ``t`` in logical order, each a view or a copy of at most ``CHUNK`` bytes."""
    if t.is_contiguous():
        yield t
        return
    if t.dim() == 0 or t.nbytes <= CHUNK:
        yield t.contiguous()
        return
    if t.dim() == 1:
        step = max(1, CHUNK // t.element_size())
        for i in range(0, t.shape[0], step):
            yield t[i : i + step].contiguous()
        return
    row_bytes = t[0].nbytes
    rows = CHUNK // row_bytes
    if rows >= 1:
        for i in range(0, t.shape[0], rows):
            yield from contiguous_blocks(t[i : i + rows])
    else:
        for i in range(t.shape[0]):
            yield from contiguous_blocks(t[i])
