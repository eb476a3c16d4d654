"""How values are hashed: exact 64-bit digests of each tensor's bytes in logical order.

CPU tensors are hashed with xxh3 over a zero-copy view of their memory (xxhash releases the GIL, so a
thread pool hashes several tensors, or several chunks of one big tensor, at once). A tensor larger than
``CHUNK`` bytes is hashed as a tree: the xxh3 of its chunks' digests, so that one large embedding does not
leave the other cores idle. Chunk boundaries depend only on the logical size, never on memory layout, so
a contiguous and a transposed-then-copied tensor with equal values hash equal.

Accelerator tensors are hashed on the device (:func:`device_digests`): each 32-bit word is paired with its
position, mixed by a bijective 64-bit finaliser and summed with wrap-around. The sum is order independent,
so the result is the same on any GPU whatever the reduction order, and because the mix is a bijection a
change of any single word always changes the digest. Only one small vector crosses to the host per audit.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import numpy as np
import torch
import xxhash

from weightsync_audit.manifest import Entry

__all__ = [
    "CHUNK",
    "SMALL",
    "digest_tensor",
    "digest_entries",
    "device_digests",
    "structure_digest",
    "overall_digest",
    "sample_rows",
]

CHUNK = 8 << 20
"""Bytes per leaf of the tree hash, and the bound on any temporary copy of a non-contiguous tensor."""

SMALL = 64 << 10
"""Tensors up to this many bytes are always hashed whole, also in sampled mode."""

_PARALLEL_MIN_BYTES = 2 << 20
_xxh = xxhash.xxh3_64_intdigest
_MASK64 = (1 << 64) - 1

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _workers() -> int:
    env = os.environ.get("WEIGHTSYNC_AUDIT_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="weightsync-digest")
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
    """A zero-copy byte view of a contiguous CPU tensor (any dtype)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return b""
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _blocks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Contiguous pieces of ``t`` in logical order, each a view or a copy of at most ``CHUNK`` bytes."""
    if t.is_contiguous():
        yield t
        return
    if t.dim() == 0 or t.numel() * t.element_size() <= CHUNK:
        yield t.contiguous()
        return
    row_bytes = (t.numel() // t.shape[0]) * t.element_size()
    if t.dim() == 1:
        step = max(1, CHUNK // t.element_size())
        for i in range(0, t.shape[0], step):
            yield t[i : i + step].contiguous()
        return
    rows = CHUNK // row_bytes
    if rows >= 1:
        for i in range(0, t.shape[0], rows):
            yield from _blocks(t[i : i + rows])
    else:
        for i in range(t.shape[0]):
            yield from _blocks(t[i])


def _leaf_digests(t: torch.Tensor) -> list[int]:
    """xxh3 of each ``CHUNK``-sized piece of the logical byte stream of CPU tensor ``t``."""
    if t.is_contiguous():
        raw = _raw(t)
        n = len(raw)
        if n <= CHUNK:
            return [_xxh(raw)]
        return [_xxh(raw[i : i + CHUNK]) for i in range(0, n, CHUNK)]
    # Stream the pieces and cut at absolute multiples of CHUNK, exactly as the contiguous case does.
    out: list[int] = []
    h = xxhash.xxh3_64()
    filled = 0
    for block in _blocks(t):
        raw = _raw(block)
        pos = 0
        while pos < len(raw):
            take = min(CHUNK - filled, len(raw) - pos)
            h.update(raw[pos : pos + take])
            filled += take
            pos += take
            if filled == CHUNK:
                out.append(h.intdigest())
                h = xxhash.xxh3_64()
                filled = 0
    if filled or not out:
        out.append(h.intdigest())
    return out


def _combine_leaves(leaves: Sequence[int]) -> int:
    if len(leaves) == 1:
        return leaves[0]
    return _xxh(np.asarray(leaves, dtype=np.uint64).tobytes(), seed=len(leaves))


def sample_rows(t: torch.Tensor, slice_index: int, slices: int) -> torch.Tensor:
    """The part of ``t`` hashed by sampled audit ``slice_index`` of ``slices``.

    Small tensors are whole in every slice; larger ones are cut into ``slices`` runs of rows along
    dimension 0, so ``slices`` consecutive audits cover every element exactly once.
    """
    if slices <= 1 or t.dim() == 0 or t.numel() * t.element_size() <= SMALL:
        return t
    d0 = t.shape[0]
    a, b = slice_index * d0 // slices, (slice_index + 1) * d0 // slices
    return t[a:b]


def digest_tensor(t: torch.Tensor, *, slice_index: int = 0, slices: int = 1) -> int:
    """The 64-bit digest (as a signed int) of a tensor's exact bytes in logical order.

    >>> import torch
    >>> digest_tensor(torch.ones(3)) == digest_tensor(torch.ones(3, 2)[:, 0])
    True
    """
    t = sample_rows(t.detach(), slice_index, slices)
    if t.device.type != "cpu":
        return device_digests([t])[0]
    return _as_signed(_combine_leaves(_leaf_digests(t)))


# -- on-device digests -------------------------------------------------------------------------

_M1 = _as_signed(0xBF58476D1CE4E5B9)
_M2 = _as_signed(0x94D049BB133111EB)
_GOLD = _as_signed(0x9E3779B97F4A7C15)
_DEVICE_WORDS = 1 << 22


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, a bijection on 64-bit words (logical shifts, wrap-around products)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _device_digest_one(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(1) if t.dim() == 0 else t
    u8 = flat.contiguous().view(-1).view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
    n = u8.numel()
    words = n // 4
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    if words:
        body = u8[: words * 4]
        if body.storage_offset() % 4:
            body = body.clone()
        w32 = body.view(torch.int32)
        for start in range(0, words, _DEVICE_WORDS):
            end = min(words, start + _DEVICE_WORDS)
            x = w32[start:end].to(torch.int64) & 0xFFFFFFFF
            pos = torch.arange(start, end, dtype=torch.int64, device=t.device)
            # (position, word) packed injectively, then mixed by a bijection: a changed word always
            # changes its term, so a single change can never cancel out of the sum.
            key = ((pos << 32) | x) ^ ((pos >> 32) * _GOLD)
            total = total + _mix64(key).sum()
    tail = n - words * 4
    if tail:
        last = torch.zeros(4, dtype=torch.uint8, device=t.device)
        last[:tail] = u8[words * 4 :]
        x = last.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        total = total + _mix64((torch.tensor(words, dtype=torch.int64, device=t.device) << 32) | x).sum()
    return _mix64(total ^ _mix64(torch.tensor(n, dtype=torch.int64, device=t.device)))


def device_digests(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Digest tensors where they live, with one host transfer for all of them.

    >>> import torch
    >>> a, b = device_digests([torch.arange(5.0), torch.arange(5.0)])
    >>> a == b
    True
    """
    if not tensors:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out = [0] * len(tensors)
    for idx in by_device.values():
        sums = torch.stack([_device_digest_one(tensors[i].detach()) for i in idx]).cpu()
        for i, v in zip(idx, sums.tolist()):
            out[i] = v
    return out


# -- many tensors ------------------------------------------------------------------------------


def digest_entries(
    entries: Sequence[Entry],
    *,
    slice_index: int = 0,
    slices: int = 1,
    method: str = "auto",
) -> np.ndarray:
    """Digests of all entries as an int64 array, in manifest order.

    ``method``: ``auto`` (xxh3 on CPU, on-device elsewhere), ``xxh3`` or ``device`` (on-device for
    every tensor, CPU included: this is how CI exercises the GPU path).
    """
    n = len(entries)
    out = np.zeros(n, dtype=np.int64)
    views = [sample_rows(e.tensor, slice_index, slices) for e in entries]
    dev_idx = [i for i, v in enumerate(views) if method == "device" or (method == "auto" and v.device.type != "cpu")]
    if dev_idx:
        for i, d in zip(dev_idx, device_digests([views[i] for i in dev_idx])):
            out[i] = d
    dev_set = set(dev_idx)
    cpu_idx = [i for i in range(n) if i not in dev_set] if dev_idx else range(n)
    if method == "xxh3":
        for i in cpu_idx:
            if views[i].device.type != "cpu":
                views[i] = views[i].cpu()

    # Split every contiguous tensor into CHUNK-sized jobs; a non-contiguous one is one job.
    jobs: list[tuple[int, int, memoryview | bytes | torch.Tensor]] = []
    leaves: dict[int, list[int]] = {}
    total = 0
    for i in cpu_idx:
        v = views[i]
        if v.is_contiguous():
            raw = _raw(v)
            size = len(raw)
            total += size
            if size <= CHUNK:
                jobs.append((i, 0, raw))
            else:
                k = (size + CHUNK - 1) // CHUNK
                leaves[i] = [0] * k
                jobs.extend((i, j, raw[j * CHUNK : (j + 1) * CHUNK]) for j in range(k))
        else:
            total += v.numel() * v.element_size()
            jobs.append((i, -1, v))

    def run(batch: Sequence[tuple[int, int, memoryview | bytes | torch.Tensor]]) -> list[tuple[int, int, int | list[int]]]:
        res: list[tuple[int, int, int | list[int]]] = []
        for i, j, item in batch:
            if j < 0:
                res.append((i, j, _leaf_digests(item)))  # type: ignore[arg-type]
            else:
                res.append((i, j, _xxh(item)))  # type: ignore[arg-type]
        return res

    workers = _workers()
    if workers > 1 and total >= _PARALLEL_MIN_BYTES and len(jobs) > 1:
        # Balance by bytes: the largest jobs first, each to the least loaded worker.
        def size_of(job: tuple[int, int, object]) -> int:
            item = job[2]
            return len(item) if not isinstance(item, torch.Tensor) else item.numel() * item.element_size()

        bins: list[list[tuple[int, int, memoryview | bytes | torch.Tensor]]] = [[] for _ in range(workers)]
        loads = [0] * workers
        for job in sorted(jobs, key=size_of, reverse=True):
            w = loads.index(min(loads))
            bins[w].append(job)
            loads[w] += size_of(job) + 256
        pool = _get_pool()
        futures = [pool.submit(run, b) for b in bins[1:] if b]
        results = run(bins[0])
        for f in futures:
            results.extend(f.result())
    else:
        results = run(jobs)

    for i, j, d in results:
        if j < 0:
            out[i] = _as_signed(_combine_leaves(d))  # type: ignore[arg-type]
        elif i in leaves:
            leaves[i][j] = d  # type: ignore[assignment]
        else:
            out[i] = _as_signed(d)  # type: ignore[arg-type]
    for i, ls in leaves.items():
        out[i] = _as_signed(_combine_leaves(ls))
    return out


def structure_digest(entries: Sequence[Entry]) -> int:
    """Digest of names, kinds, shapes and dtypes, in order."""
    text = "\x1f".join(f"{e.kind}\x1e{e.name}\x1e{e.dtype}\x1e{e.shape}" for e in entries)
    return _as_signed(_xxh(text.encode("utf-8", "surrogatepass")))


def overall_digest(digests: np.ndarray, structure: int) -> int:
    """One digest over every value digest, seeded by the structure."""
    return _as_signed(_xxh(np.ascontiguousarray(digests, dtype=np.int64).tobytes(), seed=structure & _MASK64))
