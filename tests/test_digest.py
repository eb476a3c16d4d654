"""Digests are exact and layout-independent: equal logical values hash equal whatever the memory layout,
and any single flipped bit changes the digest, for every dtype, size and method."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from dtypes import ALL_DTYPES
from harness import peak_extra_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync_audit.engine.hashing import digest as D
from weightsync_audit.engine.hashing import reader as sampling
from weightsync_audit.engine.hashing.digest import (
    digest_entries,
    digest_tensor,
    digest_tensors,
    overall_digest,
    structure_digest,
)
from weightsync_audit.engine.hashing.reader import CHUNK, host_bytes
from weightsync_audit.engine.inventory.manifest import build_manifest

METHODS = ("xxh3", "device")

DTYPES = ALL_DTYPES


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values of any dtype, drawn as raw bytes so that every bit pattern can occur."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) if shape else 1
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def strided_twin(t: torch.Tensor) -> torch.Tensor:
    """The same logical values with another memory layout (non-contiguous wherever that is possible)."""
    if t.dim() == 0:
        return t.clone()
    if t.dim() == 1:
        view = torch.zeros(2 * t.numel(), dtype=t.dtype)[::2]  # stride 2
        view.copy_(t)
        return view
    perm = list(range(t.dim()))[::-1]
    return t.permute(perm).contiguous().permute(perm)


def logical_bytes(t: torch.Tensor) -> list[int]:
    return list(host_bytes(t))


def flip_bit(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    """A contiguous copy of ``t`` with one bit of its logical byte stream flipped."""
    out = t.contiguous().clone()
    flat = out.reshape(-1).view(torch.uint8)
    flat[byte] ^= 1 << bit
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5), (2, 3, 5), (4, 0, 3), (33, 17)])
def test_layout_does_not_change_the_digest(method: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = sample(shape, dtype)
    twin = strided_twin(t)
    if t.numel() > 1 and (sum(n > 1 for n in shape) >= 2 or len(shape) == 1):
        assert not twin.is_contiguous()
    assert twin.shape == t.shape and logical_bytes(twin) == logical_bytes(t)
    assert digest_tensor(twin, method=method) == digest_tensor(t, method=method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_single_bit_flip_changes_the_digest(method: str, dtype: torch.dtype) -> None:
    t = sample((3, 5), dtype, seed=1)
    base = digest_tensor(t, method=method)
    nbytes = t.nbytes
    bits = 1 if dtype == torch.bool else 8  # bool bytes other than 0/1 are not valid values
    flipped = [flip_bit(t, byte, bit) for byte in range(nbytes) for bit in range(bits)]
    digests = digest_tensors(flipped, method=method).tolist()
    assert base not in digests
    assert len(set(digests)) == len(digests), "two different single-bit changes collided"


@pytest.mark.parametrize("method", METHODS)
def test_a_bit_flip_seen_through_a_non_contiguous_view_changes_the_digest(method: str) -> None:
    t = sample((6, 10), torch.float32, seed=2)
    twin = strided_twin(t)
    base = digest_tensor(twin, method=method)
    with torch.no_grad():
        twin.view(torch.int32)[4, 7] ^= 1 << 13
    assert digest_tensor(twin, method=method) != base
    assert digest_tensor(twin, method=method) == digest_tensor(twin.contiguous(), method=method)


def test_the_value_digest_is_over_bytes_and_the_structure_digest_tells_dtypes_apart() -> None:
    a, b = torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    assert digest_tensor(a) == digest_tensor(b)
    ea = build_manifest(torch.nn.Linear(2, 2)).entries
    eb = build_manifest(torch.nn.Linear(2, 2).double()).entries
    assert structure_digest(ea) != structure_digest(eb)


@pytest.mark.parametrize("method", METHODS)
def test_tensors_larger_than_chunk_are_exact_and_layout_independent(method: str) -> None:
    rows, cols = 4, CHUNK // 16 + 3  # just over CHUNK bytes of float32
    t = sample((rows, cols), torch.float32, seed=3)
    assert t.nbytes > CHUNK
    twin = strided_twin(t)
    base = digest_tensor(t, method=method)
    assert digest_tensor(twin, method=method) == base
    for byte in (0, CHUNK - 1, CHUNK, t.nbytes - 1):  # both sides of the first leaf boundary, and the end
        assert digest_tensor(flip_bit(t, byte, 5), method=method) != base


@pytest.mark.parametrize("leaf", [8, 24, 1000])
@given(
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8, torch.complex128, torch.bool]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25, deadline=None)
def test_leaf_boundaries_never_depend_on_layout(
    leaf: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int
) -> None:
    # A tiny CHUNK puts leaf boundaries inside rows and elements, where a layout bug would show.
    t = sample(shape, dtype, seed)
    twin = strided_twin(t)
    with mock.patch.object(D, "CHUNK", leaf), mock.patch.object(D, "SMALL", 0), mock.patch.object(sampling, "SMALL", 0):
        assert digest_tensor(twin, method="xxh3") == digest_tensor(t, method="xxh3")
        assert digest_tensor(twin, method="device") == digest_tensor(t, method="device")


def test_a_tree_hash_is_not_a_plain_hash_and_leaves_are_ordered() -> None:
    with mock.patch.object(D, "CHUNK", 16), mock.patch.object(D, "SMALL", 0), mock.patch.object(sampling, "SMALL", 0):
        a = torch.arange(8, dtype=torch.int32)  # 32 bytes: two leaves
        b = torch.cat([a[4:], a[:4]])  # the leaves swapped
        assert digest_tensor(a) != digest_tensor(b)


def test_parallel_and_serial_hashing_agree() -> None:
    big = [sample((300, 1000), torch.float32, seed=s) for s in range(6)]  # 1.2 MB each: pool jobs
    mixed = [*big, sample((5,), torch.float16), strided_twin(big[0]), torch.zeros(0)]
    with mock.patch.dict("os.environ", {"WEIGHTSYNC_AUDIT_THREADS": "1"}):
        serial = digest_tensors(mixed)
    with mock.patch.dict("os.environ", {"WEIGHTSYNC_AUDIT_THREADS": "4"}):
        parallel = digest_tensors(mixed)
    assert serial.tolist() == parallel.tolist()
    assert serial[0] == serial[7]  # the strided twin of big[0]


def test_auto_and_xxh3_agree_on_cpu_and_unknown_methods_are_refused() -> None:
    ts = [sample((40, 40), torch.float32), sample((3,), torch.bfloat16)]
    assert digest_tensors(ts, method="auto").tolist() == digest_tensors(ts, method="xxh3").tolist()
    with pytest.raises(ValueError, match="method"):
        digest_tensors(ts, method="sha1")


def test_digest_entries_follow_manifest_order_and_overall_digest_covers_them() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    entries = build_manifest(model).entries
    d = digest_entries(entries)
    assert d.dtype == np.int64 and d.shape == (4,)
    assert d.tolist() == [digest_tensor(e.tensor) for e in entries]
    s = structure_digest(entries)
    flipped = d.copy()
    flipped[2] ^= 1
    assert overall_digest(d, s) != overall_digest(flipped, s)
    assert overall_digest(d, s) != overall_digest(d, s ^ 1)


def test_structure_digest_sees_names_kinds_shapes_and_dtypes() -> None:
    base = build_manifest(torch.nn.Linear(3, 4)).entries
    s = structure_digest(base)
    renamed = build_manifest(torch.nn.Sequential(torch.nn.Linear(3, 4))).entries
    reshaped = build_manifest(torch.nn.Linear(4, 3)).entries
    retyped = build_manifest(torch.nn.Linear(3, 4).double()).entries
    assert len({s, structure_digest(renamed), structure_digest(reshaped), structure_digest(retyped)}) == 4


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_hashing_a_contiguous_model_copies_nothing() -> None:
    tensors = [torch.ones(8 << 20, dtype=torch.float32) for _ in range(3)]  # 96 MB, 12 leaves
    digest_tensors(tensors)  # warm: pool threads, lazy imports
    extra = peak_extra_bytes(lambda: digest_tensors(tensors))
    if extra is None:
        pytest.skip("cannot reset the peak RSS here")
    assert extra < 0.05 * sum(t.nbytes for t in tensors), f"{extra} bytes extra"
