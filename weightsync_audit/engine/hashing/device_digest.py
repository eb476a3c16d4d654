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

from weightsync_audit.compat import flatten_tensors
from weightsync_audit.engine.hashing.hostbytes import CHUNK, contiguous_blocks
from weightsync_audit.engine.hashing.sampling import sample_pieces

__all__ = ["device_digests", "digest_streams"]

_DEVICE_WORDS = 1 << 20
"""Words per step of the on-device digest on CPU: its scratch space is 16 bytes per word."""
_DEVICE_WORDS_ACCEL = 1 << 24
"""The same on accelerators, where each step is ~15 kernel launches and memory is plentiful."""
_DEVICE_BATCH_BYTES = 1 << 20
"""Accelerator tensors up to this size are digested together, in one batch of kernels, not one by one."""
_DEVICE_BATCH_LIMIT = 64 << 20
"""Bytes per batch of small accelerator tensors (bounds the batch's scratch space)."""
_DEVICE_PAD_LIMIT = 4 << 20
"""Bytes per batch of small tensors whose sizes are not whole words (their scatter index is 8x that)."""


def _as_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


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
    if t.is_conj() or t.is_neg():  # a lazy view: its logical values are the resolved ones (as on the host)
        t = t.resolve_conj().resolve_neg()
    flat = t.contiguous().reshape(-1)
    if flat.stride(0) != 1:  # one element with an odd stride counts as contiguous, but cannot change dtype
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def _device_stream(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    stream = _WordStream(pieces[0].device)
    for piece in pieces:
        for block in contiguous_blocks(piece):
            stream.feed(_as_bytes(block))
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
            flat = flat.reshape(-1)
            if flat.stride(0) != 1:  # one element with an odd stride counts as contiguous, but cannot change dtype
                flat = flat.as_strided((1,), (1,))
            parts.append(flat.view(torch.uint8))
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=tensors[0].device), order
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    if not _aligned(out):
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
    counts = torch.tensor(words, dtype=torch.int64, device=device)
    ends = counts.cumsum(0)
    starts = ends - counts
    if total:
        if total * 8 == flat.numel():
            w = flat.view(torch.int64)
        else:  # pad each tensor to whole words: move byte k of tensor i by its padding so far
            nbytes = torch.tensor(sizes, dtype=torch.int64, device=device)
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
    digests = _mix64(acc ^ _mix64(torch.tensor(sizes, dtype=torch.int64, device=device)))
    out = torch.empty_like(digests)
    out[torch.tensor(order, dtype=torch.int64, device=device)] = digests
    return out


def digest_streams(items: Sequence[Sequence[torch.Tensor]]) -> list[int]:
    """On-device digests of logical streams (each a list of pieces on one device); one host copy per device."""
    if not items:
        return []
    out = [0] * len(items)
    by_device: dict[torch.device, list[int]] = {}
    for i, pieces in enumerate(items):
        by_device.setdefault(pieces[0].device, []).append(i)
    for idx in by_device.values():
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
                if (
                    batch_bytes[whole] + size > (_DEVICE_BATCH_LIMIT if whole else _DEVICE_PAD_LIMIT)
                    and batches[whole][-1]
                ):
                    batches[whole].append([])
                    batch_bytes[whole] = 0
                batches[whole][-1].append(i)
                batch_bytes[whole] += size
            else:
                streamed.append(i)
        batched = [b for b in (*batches[True], *batches[False]) if b]
        results = [_device_batch([items[i][0] for i in b]) for b in batched]
        results += [_device_stream(items[i]).reshape(1) for i in streamed]
        order = [i for b in batched for i in b] + streamed
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
    return digest_streams([sample_pieces(t.detach(), slice_index, slices) for t in tensors])
