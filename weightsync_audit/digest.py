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

``device`` (accelerator tensors; forced on CPU for tests): the stream is read as little-endian 64-bit
words ``w_k`` (the last one zero-padded) and the digest is ``mix(sum_k mix(w_k + k*G) ^ mix(nbytes))``,
with splitmix64's finaliser as ``mix`` and the sum taken modulo 2**64. Integer addition is exact and
commutative, so any reduction order, on any GPU, gives the same bits; ``mix`` is a bijection and
``w -> w + k*G`` is one for each position, so a change of any single word always changes the sum. It
runs where the tensor lives, in bounded scratch space, and one small vector per device crosses to the
host per audit (instead of the model).

Sampled audits (``slices > 1``) hash slice ``i`` of every tensor larger than ``SMALL`` bytes: the run of
flat elements ``[bound(i), bound(i + 1))``, bounds rounded to ``SAMPLE_ALIGN`` elements. Slices are
disjoint and cover every element, so ``slices`` consecutive audits see the whole model.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import xxhash

from weightsync_audit.manifest import Entry

__all__ = [
    "CHUNK",
    "METHODS",
    "SAMPLE_ALIGN",
    "SMALL",
    "device_digests",
    "digest_entries",
    "digest_tensor",
    "digest_tensors",
    "overall_digest",
    "sample_bounds",
    "sample_pieces",
    "structure_digest",
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

METHODS = ("auto", "xxh3", "device")

_PARALLEL_MIN_BYTES = 2 << 20
"""Below this much data to hash in large tensors, handing work to threads costs more than it saves."""
_DEVICE_WORDS = 1 << 20
"""Words per step of the on-device digest on CPU: its scratch space is 16 bytes per word."""
_DEVICE_WORDS_ACCEL = 1 << 24
"""The same on accelerators, where each step is ~15 kernel launches and memory is plentiful."""
_DEVICE_BATCH_BYTES = 1 << 20
"""Accelerator tensors up to this size are digested together, in one batch of kernels, not one by one."""
_DEVICE_BATCH_LIMIT = 64 << 20
"""Bytes per batch of small accelerator tensors (bounds the batch's scratch space)."""

_xxh = xxhash.xxh3_64_intdigest
_EMPTY = _xxh(b"")
_MASK64 = (1 << 64) - 1

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _workers() -> int:
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
            _pool = ThreadPoolExecutor(max_workers=max(1, _workers() - 1), thread_name_prefix="weightsync-digest")
        return _pool


def _forget_pool_after_fork() -> None:
    # A forked child inherits the executor object but none of its threads: using it would hang.
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _as_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _raw(t: torch.Tensor) -> memoryview | bytes:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 and float8 included)."""
    n = t.nbytes
    if n == 0:
        return b""
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


# -- what a (sampled) audit reads ---------------------------------------------------------------


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


# -- xxh3 over CPU memory -----------------------------------------------------------------------


def _blocks(t: torch.Tensor) -> Iterator[torch.Tensor]:
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
            yield from _blocks(t[i : i + rows])
    else:
        for i in range(t.shape[0]):
            yield from _blocks(t[i])


def _stream_leaves(pieces: Sequence[torch.Tensor]) -> list[int]:
    """xxh3 of each ``CHUNK``-sized leaf of the logical byte stream of ``pieces`` (CPU tensors)."""
    out: list[int] = []
    h = xxhash.xxh3_64()
    filled = 0
    for piece in pieces:
        for block in _blocks(piece):
            raw = _raw(block)
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
    if filled or not out:
        out.append(h.intdigest())
    return out


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
        while True:
            k = next(counter)  # atomic: itertools.count is implemented in C
            if k >= len(order):
                return
            j = order[k]
            payload = jobs[j][3]
            results[j] = _stream_leaves(payload) if isinstance(payload, list) else _xxh(payload)  # type: ignore[arg-type]

    helpers = min(_workers() - 1, len(jobs) - 1)
    if helpers > 0 and sum(job[0] for job in jobs) >= _PARALLEL_MIN_BYTES:
        pool = _get_pool()
        futures = [pool.submit(drain) for _ in range(helpers)]
        drain()
        for f in futures:
            f.result()
    else:
        drain()
    return results


# -- on-device digests --------------------------------------------------------------------------

_M1 = _as_signed(0xBF58476D1CE4E5B9)
_M2 = _as_signed(0x94D049BB133111EB)
_GOLD = _as_signed(0x9E3779B97F4A7C15)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, a bijection on 64-bit words (logical shifts, wrap-around products)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _mix64_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """:func:`_mix64` in place, with ``tmp`` (same shape) as the only scratch space."""
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mult is not None:
            x.mul_(mult)
    return x


def _words_sum_fused(words: torch.Tensor, first: int) -> torch.Tensor:
    """The same sum as one expression, for ``torch.compile`` to fuse into a single reduction kernel."""
    pos = torch.arange(words.numel(), dtype=torch.int64, device=words.device) + first
    return _mix64(pos * _GOLD + words).sum()


_compiled: Callable[[torch.Tensor, int], torch.Tensor] | None = None
_compile_state = "untried"


def _compiled_words_sum() -> Callable[[torch.Tensor, int], torch.Tensor] | None:
    """The fused kernel when ``WEIGHTSYNC_AUDIT_COMPILE=1`` asks for it and ``torch.compile`` works here.

    Opt-in because compiling costs seconds once per process; eager mode runs ~15 kernels per step and
    is several times slower on a GPU. Both compute the same integers, so they give the same digests.
    """
    global _compiled, _compile_state
    if _compile_state == "untried":
        _compile_state = "off"
        if os.environ.get("WEIGHTSYNC_AUDIT_COMPILE") == "1":
            try:
                _compiled = torch.compile(_words_sum_fused, dynamic=True)
                _compile_state = "on"
            except Exception:  # noqa: BLE001 - no compiler here: eager mode is exact too
                _compiled = None
    return _compiled if _compile_state == "on" else None


def _words_sum(words: torch.Tensor, first: int) -> torch.Tensor:
    """``sum(mix(w_k + k*G))`` over int64 words ``words`` at stream positions ``first, first+1, ...``."""
    global _compile_state
    step = _DEVICE_WORDS if words.device.type == "cpu" else _DEVICE_WORDS_ACCEL
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    n = words.numel()
    if n == 0:
        return total
    fused = _compiled_words_sum()
    if fused is not None:
        try:
            for s in range(0, n, step):
                total += fused(words[s : min(n, s + step)], first + s)
            return total
        except Exception:  # noqa: BLE001 - e.g. no Triton for this device: fall back for good
            _compile_state = "failed"
            total = torch.zeros((), dtype=torch.int64, device=words.device)
    # Two scratch vectors, reused by every step: 16 bytes a word of the step, whatever the tensor size.
    x_buf = torch.empty(min(n, step), dtype=torch.int64, device=words.device)
    tmp_buf = torch.empty_like(x_buf)
    for s in range(0, n, step):
        e = min(n, s + step)
        x = x_buf[: e - s]
        torch.arange(first + s, first + e, dtype=torch.int64, device=words.device, out=x)
        x.mul_(_GOLD).add_(words[s:e])
        total += _mix64_(x, tmp_buf[: e - s]).sum()
    return total


def _aligned(u8: torch.Tensor) -> bool:
    return u8.storage_offset() % 8 == 0 and u8.data_ptr() % 8 == 0


class _WordStream:
    """Feeds a logical byte stream, piece by piece, into the positional word sum on one device.

    Pieces that start on a word boundary of the stream and of memory are read in place; anything else
    (odd sizes, odd offsets) goes through a staging buffer of at most ``CHUNK`` bytes.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.acc = torch.zeros((), dtype=torch.int64, device=device)
        self.words = 0
        self.nbytes = 0
        self.stage: torch.Tensor | None = None
        self.fill = 0

    def _flush(self, nbytes: int) -> None:
        assert self.stage is not None
        self.acc += _words_sum(self.stage[:nbytes].view(torch.int64), self.words)
        self.words += nbytes // 8
        self.fill = 0

    def feed(self, u8: torch.Tensor) -> None:
        """Append a contiguous 1-D uint8 tensor to the stream."""
        n = u8.numel()
        self.nbytes += n
        pos = 0
        while pos < n:
            if self.fill == 0 and n - pos >= 8 and _aligned(u8[pos:]):
                k = (n - pos) // 8
                self.acc += _words_sum(u8[pos : pos + 8 * k].view(torch.int64), self.words)
                self.words += k
                pos += 8 * k
                continue
            if self.stage is None:
                self.stage = torch.empty(CHUNK, dtype=torch.uint8, device=self.device)
            take = min(self.stage.numel() - self.fill, n - pos)
            self.stage[self.fill : self.fill + take].copy_(u8[pos : pos + take])
            self.fill += take
            pos += take
            if self.fill == self.stage.numel():
                self._flush(self.fill)

    def finish(self) -> torch.Tensor:
        if self.fill:
            assert self.stage is not None
            end = (self.fill + 7) // 8 * 8
            self.stage[self.fill : end].zero_()
            self._flush(end)
        size = torch.tensor(self.nbytes, dtype=torch.int64, device=self.device)
        return _mix64(self.acc ^ _mix64(size))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's logical bytes as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    flat = t.contiguous().reshape(-1)
    if flat.stride(0) != 1:  # one element with an odd stride counts as contiguous, but cannot change dtype
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def _device_stream(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    stream = _WordStream(pieces[0].device)
    for piece in pieces:
        for block in _blocks(piece):
            stream.feed(_as_bytes(block))
    return stream.finish()


def _device_batch(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Digests of many small tensors on one device with a fixed number of kernels, not a few per tensor.

    Each tensor's bytes are zero-padded to whole words and laid end to end; positions restart at every
    tensor and each tensor's word sum is a difference of one prefix sum (exact integer arithmetic).
    """
    device = tensors[0].device
    pad = torch.zeros(8, dtype=torch.uint8, device=device)
    parts: list[torch.Tensor] = []
    words: list[int] = []
    sizes: list[int] = []
    for t in tensors:
        u8 = _as_bytes(t)
        n = u8.numel()
        parts.append(u8)
        if n % 8:
            parts.append(pad[: 8 - n % 8])
        words.append((n + 7) // 8)
        sizes.append(n)
    total = sum(words)
    counts = torch.tensor(words, dtype=torch.int64, device=device)
    ends = counts.cumsum(0)
    starts = ends - counts
    if total:
        w = torch.cat(parts).view(torch.int64)
        x = torch.arange(total, dtype=torch.int64, device=device)
        x.sub_(torch.repeat_interleave(starts, counts, output_size=total))
        x.mul_(_GOLD).add_(w)
        prefix = torch.cat(
            [torch.zeros(1, dtype=torch.int64, device=device), _mix64_(x, torch.empty_like(x)).cumsum(0)]
        )
        acc = prefix[ends] - prefix[starts]
    else:
        acc = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    return _mix64(acc ^ _mix64(torch.tensor(sizes, dtype=torch.int64, device=device)))


def _device_digests_pieces(items: Sequence[Sequence[torch.Tensor]]) -> list[int]:
    """On-device digests of logical streams (each a list of pieces on one device); one host copy per device."""
    if not items:
        return []
    out = [0] * len(items)
    by_device: dict[torch.device, list[int]] = {}
    for i, pieces in enumerate(items):
        by_device.setdefault(pieces[0].device, []).append(i)
    for idx in by_device.values():
        # Small single-piece tensors go in batches of at most _DEVICE_BATCH_LIMIT bytes; the rest stream.
        batches: list[list[int]] = [[]]
        batch_bytes = 0
        streamed: list[int] = []
        for i in idx:
            pieces = items[i]
            size = sum(p.nbytes for p in pieces)
            if len(pieces) == 1 and size <= _DEVICE_BATCH_BYTES:
                if batch_bytes + size > _DEVICE_BATCH_LIMIT and batches[-1]:
                    batches.append([])
                    batch_bytes = 0
                batches[-1].append(i)
                batch_bytes += size
            else:
                streamed.append(i)
        results = [_device_batch([items[i][0] for i in b]) for b in batches if b]
        results += [_device_stream(items[i]).reshape(1) for i in streamed]
        order = [i for b in batches for i in b] + streamed
        values = torch.cat(results).cpu().tolist()  # the one device-to-host transfer
        for i, v in zip(order, values):
            out[i] = v
    return out


def device_digests(tensors: Sequence[torch.Tensor], *, slice_index: int = 0, slices: int = 1) -> list[int]:
    """Digest tensors where they live, with one host transfer per device for all of them.

    >>> import torch
    >>> a, b = device_digests([torch.arange(5.0), torch.arange(5.0).flip(0).flip(0)])
    >>> a == b
    True
    """
    return _device_digests_pieces([sample_pieces(t.detach(), slice_index, slices) for t in tensors])


# -- many tensors ------------------------------------------------------------------------------


def digest_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    slice_index: int = 0,
    slices: int = 1,
    method: str = "auto",
) -> np.ndarray:
    """Digests of ``tensors`` as an int64 array, in order.

    ``method``: ``auto`` (xxh3 on CPU, on-device elsewhere), ``xxh3`` (accelerator tensors are copied to
    the host first) or ``device`` (on-device for every tensor, CPU included: this is how CI exercises
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
    all_on_device = method == "device"
    xxh, c_char, small = _xxh, ctypes.c_char, SMALL
    for i, t in enumerate(tensors):
        if t.is_cpu and not all_on_device:
            size = t.nbytes
            if size <= small and t.is_contiguous():
                # The common case, thousands of times per audit: hash the memory in place, no job.
                out[i] = xxh((c_char * size).from_address(t.data_ptr())) if size else _EMPTY
                continue
        elif all_on_device or method == "auto":
            on_device.append(i)
            device_items.append(sample_pieces(t, slice_index, slices) if sampled else [t])
            continue
        else:
            t = t.cpu()
            size = t.nbytes
        contiguous = t.is_contiguous()
        if sampled and size > SMALL and t.dim():
            if not contiguous:
                pieces = sample_pieces(t, slice_index, slices)
                jobs.append((sum(p.nbytes for p in pieces), i, -1, pieces))
                continue
            # The slice of a contiguous tensor is a byte range of its memory: cut the view, no tensor ops.
            start, stop = sample_bounds(t.numel(), slice_index, slices)
            esize = t.element_size()
            raw = _raw(t)[start * esize : stop * esize]
            size = len(raw)
        elif not contiguous:
            jobs.append((size, i, -1, [t]))
            continue
        else:
            raw = _raw(t)
        if size <= SMALL:
            out[i] = _xxh(raw)
        elif size <= CHUNK:
            jobs.append((size, i, -1, raw))
        else:
            k = (size + CHUNK - 1) // CHUNK
            leaves[i] = [0] * k
            jobs.extend((min(CHUNK, size - j * CHUNK), i, j, raw[j * CHUNK : (j + 1) * CHUNK]) for j in range(k))
    if jobs:
        for (_, i, leaf, _payload), d in zip(jobs, _run_jobs(jobs)):
            if leaf >= 0:
                leaves[i][leaf] = d  # type: ignore[assignment]
            else:
                out[i] = _combine_leaves(d) if isinstance(d, list) else d
        for i, ls in leaves.items():
            out[i] = _combine_leaves(ls)
    result = np.array(out, dtype=np.uint64).view(np.int64) if n else np.zeros(0, dtype=np.int64)
    if on_device:
        result[on_device] = _device_digests_pieces(device_items)
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
    return int(digest_tensors([t.detach()], slice_index=slice_index, slices=slices, method=method)[0])


def structure_digest(entries: Sequence[Entry]) -> int:
    """Digest of names, kinds, shapes and dtypes, in order."""
    text = "\x1f".join([f"{e.kind}\x1e{e.name}\x1e{e.dtype}\x1e{e.shape}" for e in entries])
    return _as_signed(_xxh(text.encode("utf-8", "surrogatepass")))


def overall_digest(digests: np.ndarray, structure: int) -> int:
    """One digest over every value digest, seeded by the structure."""
    return _as_signed(_xxh(np.ascontiguousarray(digests, dtype=np.int64).tobytes(), seed=structure & _MASK64))
