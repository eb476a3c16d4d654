"""How tensors are read as host bytes: zero-copy views that keep their owner alive, and bounded copies.

Every byte the engine reads from a tensor comes through here, so no code holds a raw pointer into a
temporary: a view is a ``memoryview`` over a NumPy array whose base is the tensor itself, so the tensor
lives as long as the view does, and an accelerator or non-contiguous tensor is first copied into a
host tensor that the returned object owns.
"""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["CHUNK", "chunk_views", "contiguous_blocks", "host_bytes", "host_chunk", "host_view"]

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


def chunk_views(t: torch.Tensor, max_elems: int) -> Iterator[torch.Tensor]:
    """Views (never copies) of ``t`` in logical order, each of at most ``max_elems`` elements.

    The cut depends on the shape only, not on strides or device, so two ranks holding the same shape in
    different layouts (channels_last on one, contiguous on the other) cut it at the same elements, and
    a view can be written through (``view.copy_(...)``) as well as read.

    >>> import torch
    >>> [v.tolist() for v in chunk_views(torch.arange(6).reshape(2, 3).t(), 4)]
    [[[0, 3], [1, 4]], [[2, 5]]]
    """
    if max_elems < 1:
        raise ValueError(f"max_elems={max_elems!r}: must be >= 1")
    if t.dim() == 0 or t.numel() <= max_elems:
        if t.numel():
            yield t
        return
    if t.dim() == 1:
        for i in range(0, t.shape[0], max_elems):
            yield t[i : i + max_elems]
        return
    row = t[0].numel()
    rows = max_elems // row if row else t.shape[0]
    if rows >= 1:
        for i in range(0, t.shape[0], rows):
            yield t[i : i + rows]
    else:
        for i in range(t.shape[0]):
            yield from chunk_views(t[i], max_elems)


def host_chunk(view: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with the logical values of ``view`` (bounded by the view's size).

    The view itself when it already is one (zero-copy); otherwise an owned copy, made through the
    tensor's own ``.to("cpu")`` so that an accelerator tensor is read by its device, never by pointer.
    """
    v = view.detach()
    if v.is_conj() or v.is_neg():
        v = v.resolve_conj().resolve_neg()
    if not v.is_cpu:
        v = v.to("cpu")
    return v if v.is_contiguous() else v.contiguous()
