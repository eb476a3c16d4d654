"""How values are hashed: exact 64-bit digests of each tensor's bytes in logical order.

A digest depends only on a tensor's logical byte stream (its elements in row-major order), never on its
memory layout: a contiguous tensor and a transposed-then-copied one with equal values hash equal, on any
machine. Two methods exist; every rank must use the same one (the method is part of the audit settings
that ranks compare).

``xxh3`` (CPU tensors): xxh3-64 over a zero-copy view of the tensor's memory. xxhash releases the GIL, so
a thread pool hashes several large tensors, or several ``CHUNK``-sized leaves of one, at once. A stream
longer than ``CHUNK`` bytes is hashed as a tree (xxh3 of its leaves' digests) so one large embedding does
not leave the other cores idle. Leaf boundaries are offsets in the logical stream, so they do not depend
on layout either. Only a non-contiguous tensor is copied, one leaf at a time.

The on-device method lives in :mod:`weightsync_audit.engine.hashing.device_digest`; sampling in
:mod:`weightsync_audit.engine.hashing.reader`.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import numpy as np
import torch
import xxhash

from weightsync_audit import compat
from weightsync_audit.engine.hashing.device_digest import digest_streams
from weightsync_audit.engine.hashing.reader import (
    CHUNK,
    SMALL,
    as_signed,
    chunk_views,
    contiguous_blocks,
    host_view,
    in_place,
    readable,
    sample_bounds,
    sample_pieces,
)
from weightsync_audit.engine.inventory.manifest import Entry

__all__ = [
    "METHODS",
    "digest_entries",
    "digest_tensor",
    "digest_tensors",
    "device_type",
    "overall_digest",
    "structure_digest",
    "workers",
]

METHODS = ("auto", "xxh3", "device")

_PARALLEL_MIN_BYTES = 2 << 20
"""Below this much data to hash in large tensors, handing work to threads costs more than it saves."""

_xxh = xxhash.xxh3_64_intdigest
_EMPTY = _xxh(b"")
_MASK64 = (1 << 64) - 1

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def workers() -> int:
    """Threads that hash at once on this rank (``WEIGHTSYNC_AUDIT_THREADS``, else the usable cores, at most 8)."""
    env = os.environ.get("WEIGHTSYNC_AUDIT_THREADS")
    if env:
        return max(1, int(env))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, workers() - 1), thread_name_prefix="weightsync-digest")
        return _pool


def _forget_pool_after_fork() -> None:
    # A forked child inherits the executor object but none of its threads: using it would hang.
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


# -- xxh3 over CPU memory -----------------------------------------------------------------------


def _stream_leaves(pieces: Sequence[torch.Tensor], scratch: list[torch.Tensor] | None = None) -> list[int]:
    """xxh3 of each ``CHUNK``-sized leaf of the logical byte stream of ``pieces``.

    CPU pieces are read in place (a non-contiguous one a ``CHUNK`` at a time); accelerator pieces are
    copied to the host one ``CHUNK`` at a time into ``scratch`` (one reused buffer per hashing thread).
    """
    out: list[int] = []
    h = xxhash.xxh3_64()
    filled = 0
    for piece in pieces:
        for block in _host_blocks(piece, [] if scratch is None else scratch):
            raw = host_view(block)
            pos = 0
            while pos < len(raw):
                take = min(CHUNK - filled, len(raw) - pos)
                h.update(raw[pos : pos + take])
                filled += take
                pos += take
                if filled == CHUNK:
                    out.append(h.intdigest())
                    h.reset()
                    filled = 0
            del block, raw
    if filled or not out:
        out.append(h.intdigest())
    return out


def _host_blocks(piece: torch.Tensor, scratch: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Contiguous pieces of ``piece`` in logical order: views on the CPU; off the CPU, copies of at most
    ``CHUNK`` bytes into one host buffer (``scratch[0]``, made on first use), each made when it is hashed.
    """
    if piece.is_cpu:
        yield from contiguous_blocks(piece)
        return
    piece = piece.detach()
    esize = piece.element_size()
    for view in chunk_views(piece, max(1, CHUNK // esize)):
        if not scratch:
            scratch.append(torch.empty(CHUNK, dtype=torch.uint8))
        if view.is_conj() or view.is_neg():
            view = view.resolve_conj().resolve_neg()
        dst = scratch[0][: view.numel() * esize].view(piece.dtype).view(view.shape)
        dst.copy_(view)  # the device's own copy to the host (it waits for the device)
        yield dst


def _combine_leaves(leaves: Sequence[int]) -> int:
    if len(leaves) == 1:
        return leaves[0]
    return _xxh(np.asarray(leaves, dtype=np.uint64).tobytes(), seed=len(leaves))


def _run_jobs(jobs: list[tuple[int, int, int, object]]) -> list[int | list[int]]:
    """Hash ``(size, target, leaf, payload)`` jobs, largest first, on the pool and this thread together.

    Work is taken from a shared counter rather than pre-assigned, so a thread that loses its core to
    another rank's threads does not hold the others back.
    """
    results: list[int | list[int]] = [0] * len(jobs)
    order = sorted(range(len(jobs)), key=lambda k: -jobs[k][0])
    counter = itertools.count()

    def drain() -> None:
        scratch: list[torch.Tensor] = []  # this thread's host buffer for copies from accelerators
        while True:
            k = next(counter)  # atomic: itertools.count is implemented in C
            if k >= len(order):
                return
            j = order[k]
            payload = jobs[j][3]
            results[j] = _stream_leaves(payload, scratch) if isinstance(payload, list) else _xxh(payload)  # type: ignore[arg-type]

    helpers = min(workers() - 1, len(jobs) - 1)
    if helpers > 0 and sum(job[0] for job in jobs) >= _PARALLEL_MIN_BYTES:
        pool = _get_pool()
        futures = [pool.submit(drain) for _ in range(helpers)]
        drain()
        for f in futures:
            f.result()
    else:
        drain()
    return results


# -- many tensors ------------------------------------------------------------------------------


def _in_place(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor that the caller keeps alive while the view is used."""
    return memoryview(in_place(t)).cast("B") if t.nbytes else memoryview(b"")


def _plan_host(
    t: torch.Tensor,
    i: int,
    owned_by_caller: bool,
    sample: tuple[int, int],
    out: list[int],
    jobs: list[tuple[int, int, int, object]],
    leaves: dict[int, list[int]],
) -> None:
    """A host tensor's digest: computed at once when small, else planned as jobs (a tree of chunks when large)."""
    slice_index, slices = sample
    view = host_view if not owned_by_caller or t.is_conj() or t.is_neg() else _in_place
    contiguous = t.is_contiguous()
    size = t.nbytes
    if slices > 1 and size > SMALL and t.dim():
        if not contiguous:
            pieces = sample_pieces(t, slice_index, slices)
            jobs.append((sum(p.nbytes for p in pieces), i, -1, pieces))
            return
        # The slice of a contiguous tensor is a byte range of its memory: cut the view, no tensor ops.
        start, stop = sample_bounds(t.numel(), slice_index, slices)
        esize = t.element_size()
        raw = view(t)[start * esize : stop * esize]
        size = len(raw)
    elif not contiguous:
        jobs.append((size, i, -1, [t]))
        return
    else:
        raw = view(t)
    if size <= SMALL:
        out[i] = _xxh(raw)
    elif size <= CHUNK:
        jobs.append((size, i, -1, raw))
    else:
        k = (size + CHUNK - 1) // CHUNK
        leaves[i] = [0] * k
        jobs.extend((min(CHUNK, size - j * CHUNK), i, j, raw[j * CHUNK : (j + 1) * CHUNK]) for j in range(k))


def _run_and_collect(jobs: list[tuple[int, int, int, object]], leaves: dict[int, list[int]], out: list[int]) -> None:
    """Hash the planned jobs and put each digest (a tree's leaves combined) in its place in ``out``."""
    if not jobs:
        return
    for (_, i, leaf, _payload), d in zip(jobs, _run_jobs(jobs)):
        if leaf >= 0:
            leaves[i][leaf] = d  # type: ignore[assignment]
        else:
            out[i] = _combine_leaves(d) if isinstance(d, list) else d
    for i, ls in leaves.items():
        out[i] = _combine_leaves(ls)


def digest_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    slice_index: int = 0,
    slices: int = 1,
    method: str = "auto",
) -> np.ndarray:
    """Digests of ``tensors`` as an int64 array, in order.

    ``method``: ``auto`` (xxh3 on CPU, on-device elsewhere), ``xxh3`` (accelerator tensors are copied to
    the host in ``CHUNK``-sized pieces as they are hashed, only the sampled slice) or ``device`` (on-device for every tensor, CPU included: this is how CI exercises
    the accelerator path).
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}: choose from {list(METHODS)}")
    n = len(tensors)
    out = [0] * n
    on_device: list[int] = []
    device_items: list[list[torch.Tensor]] = []
    jobs: list[tuple[int, int, int, object]] = []  # (bytes, target, leaf or -1, memoryview | pieces)
    leaves: dict[int, list[int]] = {}
    sampled = slices > 1
    copied: set[torch.device] = set()  # devices whose tensors are copied to the host
    all_on_device = method == "device"
    xxh, small, plain, param = _xxh, SMALL, torch.Tensor, torch.nn.Parameter
    for i, t in enumerate(tensors):
        on_host = t.is_cpu and not all_on_device
        cls = type(t)
        if on_host and (cls is plain or cls is param) and t.nbytes <= small:
            # The common case, thousands of times per audit: hash the memory in place, no job. The reader
            # gives no buffer for what it cannot read so (a lazy conjugate or negative view, a non-contiguous
            # or freed one): that goes the way that resolves or refuses it.
            buf = in_place(t)
            if buf is not None:
                out[i] = xxh(buf) if t.nbytes else _EMPTY
                continue
        # Every other way reads it whole, by pointer or by a torch kernel: resolved (a DTensor's local shard)
        # and checked (meta, fake, freed storage refused by name) by the reader first.
        t = readable(t, f"tensors[{i}]")
        on_host = t.is_cpu and not all_on_device
        if not on_host:
            pieces = sample_pieces(t, slice_index, slices) if sampled else [t]
            if all_on_device or method == "auto":
                on_device.append(i)
                device_items.append(pieces)
            else:
                # xxh3 of an accelerator tensor: only what this audit samples, copied to the host chunk by
                # chunk as it is hashed (never the whole tensor, never all tensors at once).
                jobs.append((sum(p.nbytes for p in pieces), i, -1, pieces))
                copied.add(t.device)
            continue
        # A CPU tensor of the caller's is alive for this whole call (``tensors`` holds it), so its
        # memory is read in place; a temporary copy goes through host_view, which owns it.
        _plan_host(t, i, t is tensors[i], (slice_index, slices), out, jobs, leaves)
    for device in copied:  # weights written on a side stream are finished before they are copied
        compat.synchronize(device)
    _run_and_collect(jobs, leaves, out)
    result = np.array(out, dtype=np.uint64).view(np.int64) if n else np.zeros(0, dtype=np.int64)
    if on_device:
        result[on_device] = digest_streams(device_items)
    return result


def digest_entries(
    entries: Sequence[Entry],
    *,
    slice_index: int = 0,
    slices: int = 1,
    method: str = "auto",
) -> np.ndarray:
    """Digests of all manifest entries as an int64 array, in manifest order (see :func:`digest_tensors`)."""
    return digest_tensors([e.tensor for e in entries], slice_index=slice_index, slices=slices, method=method)


def digest_tensor(t: torch.Tensor, *, slice_index: int = 0, slices: int = 1, method: str = "auto") -> int:
    """The 64-bit digest (as a signed int) of a tensor's exact bytes in logical order.

    >>> import torch
    >>> digest_tensor(torch.ones(3)) == digest_tensor(torch.ones(3, 2)[:, 0])
    True
    """
    t = readable(t, "t")
    return int(digest_tensors([t], slice_index=slice_index, slices=slices, method=method)[0])


def structure_digest(entries: Sequence[Entry], *, devices: bool = True) -> int:
    """Digest of names, kinds, shapes and dtypes (and a DTensor's layout, a frozen parameter's flag), in order.

    A tensor off the CPU enters with its device type (not its index): where a tensor lives decides
    how ``auto`` digests it, so a tensor on the CPU on one rank and on a GPU on another is a difference
    of structure, never a value mismatch with a gap of 0 (``devices=False`` leaves it out: a resync
    copies between any devices). A DTensor enters with its global shape and layout, never its local
    shape or coordinates, so ranks holding different (even uneven) shards of it agree on the structure.
    """
    parts = [
        f"{e.kind}\x1e{e.name}\x1e{e.dtype}\x1e{e.shape}{'' if e.shard is None else e.shard.layout}"
        f"{'' if not e.frozen else chr(0x1D) + 'frozen'}"
        for e in entries
    ]
    if devices:
        for i in [i for i, e in enumerate(entries) if not e.tensor.is_cpu]:
            parts[i] += f"\x1e{device_type(entries[i].tensor)}"
    text = "\x1f".join(parts)
    return as_signed(_xxh(text.encode("utf-8", "surrogatepass")))


def device_type(t: torch.Tensor) -> str:
    """``cpu``, ``cuda``, ``xpu``, ``meta``...: where ``t`` lives, without its index."""
    return "cpu" if t.is_cpu else t.device.type


def overall_digest(digests: np.ndarray, structure: int) -> int:
    """One digest over every value digest, seeded by the structure."""
    return as_signed(_xxh(np.ascontiguousarray(digests, dtype=np.int64).tobytes(), seed=structure & _MASK64))
