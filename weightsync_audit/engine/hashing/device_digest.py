"""On-device digests: exact, order-independent 64-bit digests computed where the tensor lives.

``device`` (accelerator tensors; forced on CPU for tests): the stream is read as little-endian 64-bit
words ``w_k`` (the last one zero-padded) and the digest is ``mix(sum_k mix(w_k + k*G) ^ mix(nbytes))``,
with splitmix64's finaliser as ``mix`` and the sum taken modulo 2**64. Integer addition is exact and
commutative, so any reduction order, on any GPU, gives the same bits; ``mix`` is a bijection and
``w -> w + k*G`` is one for each position, so a change of any single word always changes the sum. It
runs where the tensor lives, in bounded scratch space, and one small vector per device crosses to the
host per audit (instead of the model).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch

from weightsync_audit import compat
from weightsync_audit.compat import flatten_tensors
from weightsync_audit.engine.hashing.reader import (
    CHUNK,
    as_signed,
    byte_view,
    chunk_views,
    contiguous_blocks,
    host_chunk,
    sample_pieces,
    word_aligned,
)

__all__ = ["device_digests", "device_ok", "digest_streams"]

_DEVICE_WORDS = 1 << 20
"""Words per step of the on-device digest on CPU: its scratch space is 16 bytes per word."""
_DEVICE_WORDS_ACCEL = 1 << 24
"""The same on accelerators, where each step is ~15 kernel launches: 256 MiB of scratch (two int64
vectors of 128 MiB), halved on out-of-memory down to ``_MIN_WORDS`` (see :func:`_scratch`)."""
_MIN_WORDS = 1 << 12
"""The smallest step the halving on out-of-memory goes down to before it gives up."""
_step_of: dict[str, int] = {}
"""Per device type, a step smaller than the default that an out-of-memory error forced (kept for good)."""
_DEVICE_BATCH_BYTES = 1 << 20
"""Accelerator tensors up to this size are digested together, in one batch of kernels, not one by one."""
_DEVICE_BATCH_LIMIT = 64 << 20
"""Bytes per batch of small accelerator tensors (bounds the batch's scratch space)."""
_DEVICE_PAD_LIMIT = 4 << 20
"""Bytes per batch of small tensors whose sizes are not whole words (their scatter index is 8x that)."""


_M1 = as_signed(0xBF58476D1CE4E5B9)
_M2 = as_signed(0x94D049BB133111EB)
_GOLD = as_signed(0x9E3779B97F4A7C15)


def _mix_int(x: int) -> int:
    """:func:`_mix64` of one Python integer, on the host (no tensor, so no host-to-device copy)."""
    m = (1 << 64) - 1
    x &= m
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    return as_signed(x ^ (x >> 31))


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
    x_buf, step = _scratch(min(n, step), words.device)
    tmp_buf = x_buf[step:]
    for s in range(0, n, step):
        e = min(n, s + step)
        x = x_buf[: e - s]
        torch.arange(first + s, first + e, dtype=torch.int64, device=words.device, out=x)
        x.mul_(_GOLD).add_(words[s:e])
        total += _mix64_(x, tmp_buf[: e - s]).sum()
    return total


def _alloc(n: int, device: torch.device) -> torch.Tensor:
    return torch.empty(n, dtype=torch.int64, device=device)


def _scratch(words: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """One int64 buffer of ``2 * step`` words and the step: halved on out-of-memory, the smaller step
    kept for this device type, so that an audit on a nearly full accelerator slows down, not fails."""
    step = min(words, _step_of.get(device.type, words))
    while True:
        try:
            return _alloc(2 * step, device), step
        except torch.OutOfMemoryError:
            if step <= _MIN_WORDS:
                raise
            step = max(_MIN_WORDS, step // 2)
            _step_of[device.type] = step


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
            if self.fill == 0 and n - pos >= 8 and word_aligned(u8[pos:]):
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
        return _mix64(self.acc ^ _mix_int(self.nbytes))


def _device_stream(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    stream = _WordStream(pieces[0].device)
    for piece in pieces:
        for block in contiguous_blocks(piece):
            stream.feed(byte_view(block))
    return stream.finish()


def _flat_bytes(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The logical bytes of ``tensors`` end to end, one flatten (a single C++ call) per dtype, and their order.

    Tensors of one dtype are flattened together by :func:`~weightsync_audit.compat.flatten_tensors`
    (contiguous, reshape and concatenate in one call): a batch costs one launch per dtype group, not one per tensor.
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    order: list[int] = []
    parts: list[torch.Tensor] = []
    for idx in by_dtype.values():
        order.extend(idx)
        flat = flatten_tensors([tensors[i] for i in idx])
        if flat.numel():
            parts.append(byte_view(flat))
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=tensors[0].device), order
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    if not word_aligned(out):
        out = out.clone()
    return out, order


def _device_batch(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Digests of many small tensors on one device with a fixed number of kernels, not a few per tensor.

    Each tensor's bytes are zero-padded to whole words and laid end to end; positions restart at every
    tensor and each tensor's word sum is a difference of one prefix sum (exact integer arithmetic). The
    bytes are gathered by one flatten per dtype; when some sizes are not whole words, one scatter moves
    them to their padded places.
    """
    device = tensors[0].device
    flat, order = _flat_bytes(tensors)
    sizes = [tensors[i].nbytes for i in order]
    words = [(n + 7) // 8 for n in sizes]
    total = sum(words)
    # Every small index the batch needs, built on the host and moved in one copy (not one per list).
    k = len(tensors)
    index = torch.tensor([*words, *sizes, *order], dtype=torch.int64).to(device)
    counts, nbytes, where = index[:k], index[k : 2 * k], index[2 * k :]
    ends = counts.cumsum(0)
    starts = ends - counts
    if total:
        if total * 8 == flat.numel():
            w = flat.view(torch.int64)
        else:  # pad each tensor to whole words: move byte k of tensor i by its padding so far
            shift = starts * 8 - (nbytes.cumsum(0) - nbytes)
            dest = torch.arange(flat.numel(), dtype=torch.int64, device=device)
            dest += torch.repeat_interleave(shift, nbytes, output_size=flat.numel())
            padded = torch.zeros(total * 8, dtype=torch.uint8, device=device)
            padded[dest] = flat
            del dest
            w = padded.view(torch.int64)
        x = torch.arange(total, dtype=torch.int64, device=device)
        x.sub_(torch.repeat_interleave(starts, counts, output_size=total))
        x.mul_(_GOLD).add_(w)
        prefix = torch.cat(
            [torch.zeros(1, dtype=torch.int64, device=device), _mix64_(x, torch.empty_like(x)).cumsum(0)]
        )
        acc = prefix[ends] - prefix[starts]
    else:
        acc = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    digests = _mix64(acc ^ _mix64(nbytes))
    out = torch.empty_like(digests)
    out[where] = digests
    return out


def _on_device(items: Sequence[Sequence[torch.Tensor]], idx: list[int]) -> tuple[list[int], torch.Tensor]:
    """Digests of ``items[i]`` for ``i`` in ``idx`` (all on one device) as one device vector, and their order."""
    # Small single-piece tensors go in batches of at most _DEVICE_BATCH_LIMIT bytes (sizes of whole
    # words) or _DEVICE_PAD_LIMIT bytes (others: their padding scatter needs 8 bytes of index a byte).
    batches: dict[bool, list[list[int]]] = {True: [[]], False: [[]]}
    batch_bytes = {True: 0, False: 0}
    streamed: list[int] = []
    for i in idx:
        pieces = items[i]
        size = sum(p.nbytes for p in pieces)
        if len(pieces) == 1 and size <= _DEVICE_BATCH_BYTES and not (pieces[0].is_conj() or pieces[0].is_neg()):
            whole = size % 8 == 0
            if batch_bytes[whole] + size > (_DEVICE_BATCH_LIMIT if whole else _DEVICE_PAD_LIMIT) and batches[whole][-1]:
                batches[whole].append([])
                batch_bytes[whole] = 0
            batches[whole][-1].append(i)
            batch_bytes[whole] += size
        else:
            streamed.append(i)
    batched = [b for b in (*batches[True], *batches[False]) if b]
    results = []
    for b in batched:
        try:
            results.append(_device_batch([items[i][0] for i in b]))
        except torch.OutOfMemoryError:  # a batch's scratch does not fit: one by one, in bounded steps
            results.append(torch.cat([_device_stream([items[i][0]]).reshape(1) for i in b]))
    results += [_device_stream(items[i]).reshape(1) for i in streamed]
    return [i for b in batched for i in b] + streamed, torch.cat(results)


def _host_stream(pieces: Sequence[torch.Tensor]) -> int:
    """The same digest computed on the host from copies of at most ``CHUNK`` bytes (bounded host memory)."""
    stream = _WordStream(torch.device("cpu"))
    for piece in pieces:
        for view in chunk_views(piece.detach(), max(1, CHUNK // piece.element_size())):
            stream.feed(byte_view(host_chunk(view)))
    return int(stream.finish())


_PROBE_EXEMPT = {"cpu"}
"""Device types that need no probe: the CPU is where the reference arithmetic runs."""
_probed: dict[str, bool] = {}
"""Per device type, whether its first-use probe gave the reference digests."""
_PROBE_EXPECTED = [-1553338955904980227, 4390646962837315090, -8382803635762508947]
"""The probe's digests by the written definition (a pure-Python computation, see the tests)."""


def _probe_items() -> list[list[torch.Tensor]]:
    """Small host streams that take every path: a padded batch, a whole-word batch, a streamed pair."""
    odd = (torch.arange(13) * 37 % 251).to(torch.uint8)
    words = torch.arange(-8, 40, dtype=torch.int64) * 0x9E3779B97F4A7C1
    halves = torch.arange(-500, 500, dtype=torch.int16) * 131
    return [[odd], [words], [halves[:7], halves[7:]]]


def device_ok(device: torch.device) -> bool:
    """Whether the int64 arithmetic of ``device`` gives the reference digests (probed once per device type).

    The digest needs exact 64-bit wrap-around products, logical shifts and sums; a backend without
    them (some MPS, XLA or HPU builds) would give wrong digests. On first use of a device type a few
    small streams are digested there and compared with the written definition; if they differ, or
    the device raises, that device type's tensors are digested on the host instead (same digests).
    """
    if device.type in _PROBE_EXEMPT:
        return True
    ok = _probed.get(device.type)
    if ok is None:
        try:
            items = [[p.to(device) for p in item] for item in _probe_items()]
            order, values = _on_device(items, list(range(len(items))))
            got = dict(zip(order, values.cpu().tolist()))
            ok = [got[i] for i in range(len(items))] == _PROBE_EXPECTED
        except Exception:  # noqa: BLE001 - any failure of the device's arithmetic: use the host
            ok = False
        _probed[device.type] = ok
    return ok


def digest_streams(items: Sequence[Sequence[torch.Tensor]]) -> list[int]:
    """On-device digests of logical streams (each a list of pieces on one device); one host copy per device.

    Each device is synchronized first (all its streams, through :func:`weightsync_audit.compat.synchronize`),
    so weights written on a side stream are read finished. A device type whose probe failed
    (:func:`device_ok`) is digested on the host, in chunks.
    """
    if not items:
        return []
    out = [0] * len(items)
    by_device: dict[torch.device, list[int]] = {}
    for i, pieces in enumerate(items):
        by_device.setdefault(pieces[0].device, []).append(i)
    for device, idx in by_device.items():
        compat.synchronize(device)
        if not device_ok(device):
            for i in idx:
                out[i] = _host_stream(items[i])
            continue
        order, values = _on_device(items, idx)
        for i, v in zip(order, values.cpu().tolist()):  # the one device-to-host transfer
            out[i] = v
    return out


def device_digests(tensors: Sequence[torch.Tensor], *, slice_index: int = 0, slices: int = 1) -> list[int]:
    """Digest tensors where they live, with one host transfer per device for all of them.

    >>> import torch
    >>> a, b = device_digests([torch.arange(5.0), torch.arange(5.0).flip(0).flip(0)])
    >>> a == b
    True
    """
    return digest_streams([sample_pieces(t.detach(), slice_index, slices) for t in tensors])
