"""The on-device digest, run on CPU tensors (the same code runs on accelerators).

It must match its written definition bit for bit (a pure-Python reference below), agree between its
batched and streamed forms, whatever the layout, alignment or step size, tell any reordering apart,
use bounded scratch space, and cross to the host once per device per call.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from dtypes import ALL_DTYPES
from harness import peak_extra_bytes
from ranks import run_ranks
from torch import nn

from weightsync_audit import Auditor
from weightsync_audit.engine.hashing import device_digest as D
from weightsync_audit.engine.hashing.device_digest import device_digests
from weightsync_audit.engine.hashing.digest import digest_tensor, digest_tensors
from weightsync_audit.engine.hashing.reader import host_bytes

_M64 = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def reference(data: bytes) -> int:
    """The device digest as documented: mix(sum_k mix(w_k + k*G) ^ mix(nbytes)), as a signed int64."""
    padded = data + bytes(-len(data) % 8)
    acc = 0
    for k in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * k : 8 * k + 8], "little")
        acc = (acc + _mix((w + k * _G) & _M64)) & _M64
    d = _mix(acc ^ _mix(len(data)))
    return d - (1 << 64) if d >= 1 << 63 else d


def logical(t: torch.Tensor) -> bytes:
    return host_bytes(t)


def rand_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000])
def test_matches_the_written_definition_for_every_tail_length(n: int) -> None:
    t = rand_bytes(n, seed=n)
    assert digest_tensor(t, method="device") == reference(logical(t))


@pytest.mark.parametrize(
    "t",
    [
        torch.tensor(3.5, dtype=torch.bfloat16),
        torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        torch.tensor([True, False, True]),
        torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
        rand_bytes(40).view(torch.float8_e4m3fn).reshape(5, 8)[:, 1:6],
        torch.zeros(2, 0, 3),
    ],
    ids=["bf16-0dim", "transposed", "bool", "complex", "float8-strided", "empty"],
)
def test_matches_the_definition_for_any_dtype_and_layout(t: torch.Tensor) -> None:
    assert digest_tensor(t, method="device") == reference(logical(t))


def _mixed_tensors() -> list[torch.Tensor]:
    base = rand_bytes(6000, seed=5)
    return [
        base[:13],  # odd length
        base[3:3003],  # misaligned in memory: goes through the staging buffer
        base.view(torch.int16)[: 30 * 90].reshape(30, 90)[:, ::3],  # rows of 60 bytes, strided
        base[:4000].view(torch.float32).reshape(50, 20).t(),  # transposed
        base[:5000].reshape(1000, 5)[:, :3],  # rows of 3 bytes: every row boundary splits a word
        torch.tensor(7, dtype=torch.int64),
        torch.empty(0, dtype=torch.bfloat16),
    ]


def test_batched_and_streamed_forms_agree() -> None:
    ts = _mixed_tensors()
    batched = device_digests(ts)
    with mock.patch.object(D, "_DEVICE_BATCH_BYTES", -1):  # everything streamed, one by one
        streamed = device_digests(ts)
    assert batched == streamed == [reference(logical(t)) for t in ts]


@pytest.mark.parametrize("words", [1, 3, 64])
@pytest.mark.parametrize("chunk", [8, 24, 4096])
def test_step_size_and_staging_size_do_not_change_the_result(words: int, chunk: int) -> None:
    ts = _mixed_tensors()
    expected = [reference(logical(t)) for t in ts]
    with (
        mock.patch.object(D, "_DEVICE_WORDS", words),
        mock.patch.object(D, "CHUNK", chunk),
        mock.patch.object(D, "_DEVICE_BATCH_BYTES", -1),
    ):
        assert device_digests(ts) == expected


def test_small_batches_are_split_by_size_without_changing_results() -> None:
    ts = [rand_bytes(n, seed=n) for n in range(1, 300, 7)]
    with mock.patch.object(D, "_DEVICE_BATCH_LIMIT", 100):
        assert device_digests(ts) == [reference(logical(t)) for t in ts]


def test_a_batch_of_every_dtype_and_size_is_one_flatten_per_dtype_and_exact() -> None:
    ts = []
    for k, dtype in enumerate(ALL_DTYPES):
        for n in (0, 1, 3, 8, 17):
            itemsize = torch.empty((), dtype=dtype).element_size()
            raw = rand_bytes(n * itemsize, seed=k * 31 + n)
            ts.append((raw & 1 if dtype == torch.bool else raw).view(dtype))
    ts.append(torch.tensor([1 + 2j, 3 - 1j]).conj())  # a conjugate view: digested on its own, resolved
    with mock.patch.object(D, "_DEVICE_PAD_LIMIT", 40):  # several padded batches
        assert device_digests(ts) == [reference(logical(t)) for t in ts]


def test_any_reordering_changes_the_digest() -> None:
    t = torch.arange(64, dtype=torch.int64)
    base = digest_tensor(t, method="device")
    for i, j in [(0, 1), (0, 63), (10, 40)]:
        swapped = t.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert digest_tensor(swapped, method="device") != base
    assert digest_tensor(t.roll(1), method="device") != base
    # Equal words at different positions, and a zero appended, are told apart too.
    assert digest_tensor(torch.zeros(2, dtype=torch.int64), method="device") != digest_tensor(
        torch.zeros(3, dtype=torch.int64), method="device"
    )


def test_word_sums_wrap_exactly_like_the_definition() -> None:
    t = torch.full((50,), -1, dtype=torch.int64)  # all-ones words: sums overflow many times
    assert digest_tensor(t, method="device") == reference(logical(t))


def test_the_host_sees_one_transfer_per_call_and_never_a_scalar_read() -> None:
    ts = [*_mixed_tensors(), torch.randn(300, 300), torch.randn(5)]
    calls = []
    original = torch.Tensor.cpu

    def counting_cpu(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    with (
        mock.patch.object(torch.Tensor, "cpu", counting_cpu),
        mock.patch.object(torch.Tensor, "item", side_effect=AssertionError("a per-tensor host sync")),
    ):
        digest_tensors(ts, method="device")
    assert calls == [(len(ts),)]


def test_runs_under_deterministic_algorithms() -> None:
    ts = _mixed_tensors()
    before = device_digests(ts)
    torch.use_deterministic_algorithms(True)
    try:
        assert device_digests(ts) == before
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_scratch_space_is_bounded_whatever_the_tensor_size() -> None:
    t = torch.ones(12 << 20, dtype=torch.float64)  # 96 MB
    digest_tensor(torch.ones(10), method="device")  # warm: lazy imports
    extra = peak_extra_bytes(lambda: digest_tensor(t, method="device"))
    if extra is None:
        pytest.skip("cannot reset the peak RSS here")
    bound = 16 * D._DEVICE_WORDS + D.CHUNK + (4 << 20)
    assert extra < bound, f"{extra / 1e6:.1f} MB of scratch for a {t.nbytes / 1e6:.0f} MB tensor"


def _device_method_audit(rank: int, world: int) -> list[tuple[bool, list[str]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.Linear(300, 3))  # 76 KB weight: sampled in slices
    auditor = Auditor(model, method="device")
    sampled = Auditor(model, method="device", coverage="1/2")
    out = [(r.in_sync, r.diverged_names) for r in (auditor.audit(step=0), sampled.audit(step=0))]
    if rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] = torch.nextafter(model[0].weight[0, 0], torch.tensor(2.0))
    out += [
        (r.in_sync, r.diverged_names) for r in (auditor.audit(step=1), sampled.audit(step=1), sampled.audit(step=2))
    ]
    return out


def test_device_method_on_real_ranks_finds_one_ulp_and_respects_sampling() -> None:
    r0, r1 = run_ranks(_device_method_audit, 2)
    assert r0 == r1
    assert r0[0] == (True, []) and r0[1] == (True, [])
    assert r0[2] == (False, ["0.weight"])
    # The changed element lies in slice 0: the sampled auditor's second audit reads slice 1, its third slice 0.
    assert r0[3] == (True, []) and r0[4] == (False, ["0.weight"])


def test_the_opt_in_compiled_kernel_gives_the_same_digests() -> None:
    ts = _mixed_tensors()
    expected = [reference(logical(t)) for t in ts]
    with (
        mock.patch.dict("os.environ", {"WEIGHTSYNC_AUDIT_COMPILE": "1"}),
        mock.patch.object(D, "_compile_state", "untried"),
        mock.patch.object(D, "_compiled", None),
        mock.patch.object(D, "_DEVICE_BATCH_BYTES", -1),  # streamed: the path that uses the kernel
    ):
        got = device_digests(ts)
        state = D._compile_state
    assert got == expected
    if state != "on":
        pytest.skip(f"torch.compile is not usable here ({state}); the eager fallback gave the right digests")
