"""The one reader of tensor bytes: every byte the package reads from a tensor comes through here.

:func:`readable` resolves a tensor before anything reads it (a DTensor or other ``to_local()`` wrapper to its
local data, an autograd tensor to its detached alias) and refuses by name what has no bytes to read: meta and
fake tensors, sparse and nested layouts, storage freed or shrunk under its view. Bytes are then read only by
:func:`in_place` (zero-copy, by address, for a plain contiguous CPU tensor whose storage holds it), the
host views and bounded pieces (:func:`host_view`, :func:`contiguous_blocks`, :func:`chunk_views`,
:func:`host_chunk`) and a sampled audit's slices (:func:`sample_pieces`). No other module reads memory by
address (``tests/test_layout.py``).
"""

from __future__ import annotations

import ctypes
from typing import Any, Iterator

import torch

from weightsync_audit.errors import UnauditableTensorError

__all__ = [
    "CHUNK",
    "FREED",
    "SAMPLE_ALIGN",
    "SMALL",
    "as_signed",
    "byte_view",
    "chunk_views",
    "contiguous_blocks",
    "host_bytes",
    "host_chunk",
    "host_view",
    "in_place",
    "readable",
    "sample_bounds",
    "sample_pieces",
    "storage_fits",
    "word_aligned",
]

CHUNK = 8 << 20
"""Bytes per leaf of the xxh3 tree hash, and the bound on any temporary copy of a non-contiguous tensor."""

SMALL = 64 << 10
"""Tensors up to this many bytes are hashed whole in every audit, also in sampled mode: hashing them
costs about as much as the bookkeeping of a slice, and whole small tensors (biases, norms, optimizer
scalars) are then never stale."""

SAMPLE_ALIGN = 64
"""Slice bounds are multiples of this many elements, so every slice starts on a 64-byte boundary (the
device method can then read it as 64-bit words without a copy)."""

FREED = (
    "its storage is smaller than its view needs (freed or resized under it, e.g. by "
    "untyped_storage().resize_(0)); it is not read"
)

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_c_char = ctypes.c_char


def as_signed(x: int) -> int:
    """A 64-bit word as the signed integer an ``int64`` holds."""
    return x - (1 << 64) if x >= 1 << 63 else x


def readable(t: Any, name: str = "tensor") -> torch.Tensor:
    """``t`` as a plain strided tensor whose bytes can be read; else :class:`UnauditableTensorError` naming ``name``.

    A DTensor (an FSDP2 parameter or gradient, a TP shard) gives its local shard. Metadata only: nothing is read.

    >>> import torch
    >>> readable(torch.ones(2, requires_grad=True), "w").requires_grad
    False
    >>> readable(torch.empty(2, device="meta"), "w")
    Traceback (most recent call last):
    ...
    weightsync_audit.errors.UnauditableTensorError: cannot audit 'w': it is a meta tensor (it has no data); materialise the model first
    """
    cls = type(t)
    if cls is not _Tensor and cls is not _Parameter:
        if hasattr(t, "to_local"):
            t = t.to_local()  # a DTensor's (or another wrapper's) local data
        if not isinstance(t, _Tensor):
            raise UnauditableTensorError(name, f"a {type(t).__name__} is not a tensor")
    if cls is _Parameter or t.requires_grad:
        # Not ``.data``: that alias has a version counter of its own; ``detach()`` shares the tensor's.
        t = t.detach()
    if t.is_meta:
        raise UnauditableTensorError(name, "it is a meta tensor (it has no data); materialise the model first")
    if t.layout is not torch.strided:
        if t.layout == torch.sparse_coo:
            raise UnauditableTensorError(
                name, "sparse COO tensors are not audited; exclude it or convert with .to_dense()"
            )
        raise UnauditableTensorError(name, f"layout {t.layout} is not audited; exclude it")
    if t.is_nested:
        raise UnauditableTensorError(name, "nested tensors are not audited; exclude it")
    if cls is not _Tensor and cls is not _Parameter and not t.numel() == 0:
        _has_own_storage(t, name)
    if not storage_fits(t):
        raise UnauditableTensorError(name, FREED)
    return t


def _has_own_storage(t: torch.Tensor, name: str) -> None:
    """Refuse a subclass whose bytes are not in a storage of its own (a fake tensor, a wrapper without data)."""
    try:
        storage = t.untyped_storage()
    except Exception as exc:  # noqa: BLE001 - any subclass that cannot give a storage is not read
        raise UnauditableTensorError(name, f"a {type(t).__name__} has no storage to read ({exc})") from None
    if storage.device.type == "meta":
        raise UnauditableTensorError(name, f"a {type(t).__name__} has no data (its storage is on meta): a fake tensor")
    if storage.nbytes() == 0 or storage.data_ptr() == 0:
        raise UnauditableTensorError(name, FREED)


def storage_fits(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds every byte its view reaches (``False``: freed or shrunk under it).

    A storage resized under a tensor (``p.untyped_storage().resize_(0)``) leaves the tensor's shape and
    strides pointing at memory it no longer owns; reading it, by pointer or by any torch kernel, is a
    crash or worse. Metadata only: nothing is read.

    >>> import torch
    >>> t = torch.ones(4)
    >>> storage_fits(t), storage_fits(t[1:])
    (True, True)
    >>> _ = t.untyped_storage().resize_(0)
    >>> storage_fits(t)
    False
    """
    try:
        held = t.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001 - no plain storage to measure: readable() refuses it by name
        return True
    offset = t.storage_offset()
    if not offset and t.is_contiguous():  # the common case, thousands of times per manifest
        return held >= t.nbytes
    if t.numel() == 0:
        return True
    reach = offset + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return held >= reach * t.element_size()


# -- zero-copy reads of host memory -------------------------------------------------------------


def in_place(t: torch.Tensor) -> Any:
    """A zero-copy byte buffer over a contiguous CPU tensor's memory, or ``None`` where it cannot be one.

    ``None`` for anything but a plain (or ``Parameter``), contiguous, resolved (not lazily conjugated or negated) CPU tensor
    whose storage holds it. The buffer keeps nothing alive: the caller holds ``t`` while it is read.
    """
    cls = type(t)
    if (
        (cls is not _Tensor and cls is not _Parameter)
        or not t.is_cpu
        or not t.is_contiguous()
        or t.is_conj()
        or t.is_neg()
    ):
        return None
    n = t.nbytes
    if not n:
        return b""
    if t.untyped_storage().nbytes() < n + t.storage_offset() * t.element_size():
        return None
    return (_c_char * n).from_address(t.data_ptr())


def word_aligned(u8: torch.Tensor) -> bool:
    """Whether a byte tensor's data starts on an 8-byte boundary of its storage and of memory."""
    return u8.storage_offset() % 8 == 0 and u8.data_ptr() % 8 == 0


def host_view(t: torch.Tensor) -> memoryview:
    """The logical bytes of ``t`` as a ``memoryview`` that keeps its memory alive.

    Zero-copy for a contiguous CPU tensor (any dtype, bf16 and float8 included); any other tensor
    (on an accelerator, non-contiguous, conjugated) is copied to a host tensor that the view owns.

    >>> import torch
    >>> bytes(host_view(torch.tensor([1, 2], dtype=torch.int16)))
    b'\\x01\\x00\\x02\\x00'
    """
    t = t.detach()
    # .numpy() makes an array whose base holds the tensor: the memory stays valid while the view lives.
    return memoryview(byte_view(t if t.is_cpu else t.to("cpu")).numpy())


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's logical bytes as a flat uint8 tensor on its device (a view when ``t`` is contiguous)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if t.is_conj() or t.is_neg():  # a lazy view: its logical values are the resolved ones
        t = t.resolve_conj().resolve_neg()
    flat = t.contiguous().reshape(-1)
    if flat.stride(0) != 1:  # one element with an odd stride counts as contiguous, but cannot change dtype
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def host_bytes(t: torch.Tensor, name: str = "tensor") -> bytes:
    """An owned ``bytes`` copy of the logical bytes of ``t``, from any device and layout (resolved first)."""
    return bytes(host_view(readable(t, name)))


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


# -- what a sampled audit reads -----------------------------------------------------------------


def sample_bounds(numel: int, slice_index: int, slices: int) -> tuple[int, int]:
    """Flat element range ``[start, stop)`` of slice ``slice_index`` of ``slices`` of a tensor.

    Slices are disjoint and cover every element (bounds rounded to ``SAMPLE_ALIGN`` elements), so
    ``slices`` consecutive sampled audits see the whole model.

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
