"""The accelerator path on CPU stand-ins: state placement after resync, optimizer state over the data
plane, bounded host copies for xxh3, the stream synchronization contract, the device type in the
structure, the first-use probe, host-to-device transfers and the scratch budget under out-of-memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from fakedevice import COPIED, MetaAccel, fake, reset_copies
from harness import peak_extra_bytes
from ranks import run_ranks
from test_device_digest import reference
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from weightsync_audit import Auditor, compat, resync
from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.hashing import device_digest as D
from weightsync_audit.engine.hashing.digest import digest_tensors, workers
from weightsync_audit.engine.hashing.reader import CHUNK, host_bytes
from weightsync_audit.engine.repair.resync import _install_state, move_copies, state_device

# -- 2: where rebuilt optimizer state lives ----------------------------------------------------------


@pytest.mark.parametrize("flag", ["fused", "capturable", None])
def test_rebuilt_step_stays_on_the_parameter_device_for_fused_and_capturable_adam(flag: str | None) -> None:
    model = nn.Linear(3, 2, device="meta")  # meta stands for the accelerator the parameters live on
    opt = torch.optim.Adam(model.parameters(), **({flag: True} if flag else {}))
    spec = {"t": ["float32", []]}
    _install_state({"weight.step": spec, "weight.exp_avg": {"t": ["float32", [2, 3]]}}, [opt], model)
    state = opt.state[model.weight]
    assert state["step"].device.type == ("meta" if flag else "cpu")  # torch's own placement rule
    assert state["exp_avg"].device.type == "meta"
    assert state_device(model.weight, opt.param_groups[0], "exp_avg", 2).type == "meta"


# -- 3: optimizer state over the data plane ----------------------------------------------------------


def _resync_fresh_optimizer(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(256, 256)  # 256 KiB weight: 512 KiB of Adam moments for it
    opt = torch.optim.Adam(model.parameters())
    if rank == 0:  # only the source has stepped: the others have no state to overwrite
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
    star = Comm()
    star.setup()
    before = star.sent_bytes
    resync(model, opt, src=0, timeout_s=30)
    through_star = star.sent_bytes - before
    moments = opt.state[model.weight]["exp_avg_sq"]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, host_bytes(moments))
    return {"star": through_star, "same": len(set(gathered)) == 1, "step": float(opt.state[model.weight]["step"])}


def test_optimizer_state_created_by_resync_travels_over_the_data_plane_not_the_star() -> None:
    results = run_ranks(_resync_fresh_optimizer, 2)
    for got in results:
        assert got["same"] and got["step"] == 1.0
        assert got["star"] < 64 << 10, f"{got['star']} bytes of the 1 MiB optimizer state went through the star"


def _shard_style_copies(rank: int, world: int) -> list[list[float]]:
    # Per-pair copies as shard resync makes them: a source other than the resync's, a subset of receivers.
    a = torch.full((3, 5), float(rank)).t()  # non-contiguous: written in place through its views
    b = torch.full((70000,), float(10 + rank))
    move_copies(Comm(timeout_s=30), 0, [("a", a, 1, [2]), ("b", b, 0, [1])])
    return [sorted(set(a.flatten().tolist())), sorted(set(b.tolist()))]


def test_shard_copies_go_point_to_point_over_the_data_plane_from_any_source_to_some_receivers() -> None:
    got = run_ranks(_shard_style_copies, 3)
    assert got == [[[0.0], [10.0]], [[1.0], [10.0]], [[1.0], [12.0]]]


# -- 4: xxh3 of accelerator tensors in bounded host memory --------------------------------------------


def test_xxh3_of_an_accelerator_tensor_copies_chunks_of_at_most_chunk_bytes_and_only_the_sampled_slice() -> None:
    host = torch.randn(5 << 20)  # 20 MiB: three chunks
    dev = fake(host)
    reset_copies()
    assert digest_tensors([dev], method="xxh3")[0] == digest_tensors([host], method="xxh3")[0]
    assert COPIED["largest"] <= CHUNK and COPIED["bytes"] == host.nbytes
    reset_copies()
    sampled = digest_tensors([dev], method="xxh3", slice_index=3, slices=8)[0]
    assert sampled == digest_tensors([host], method="xxh3", slice_index=3, slices=8)[0]
    assert COPIED["bytes"] <= host.nbytes // 8 + 4096


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_xxh3_of_accelerator_tensors_holds_a_few_chunks_of_host_memory_whatever_the_model_size() -> None:
    tensors = [fake(torch.ones(6 << 20)) for _ in range(4)]  # 96 MiB "on the device"
    digest_tensors([fake(torch.ones(10))], method="xxh3")  # warm: lazy imports, the thread pool
    extra = peak_extra_bytes(lambda: digest_tensors(tensors, method="xxh3"))
    if extra is None:
        pytest.skip("cannot reset the peak RSS here")
    # One reused CHUNK-sized host buffer per hashing thread (before: every tensor copied whole).
    bound = (workers() + 1) * CHUNK
    assert extra < bound, f"{extra / 2**20:.0f} MiB of host memory for 96 MiB of device tensors"


# -- 5: synchronize every stream before reading ------------------------------------------------------


def test_device_digests_and_host_copies_synchronize_the_device_first() -> None:
    seen: list[torch.device] = []
    with mock.patch.object(compat, "synchronize", side_effect=seen.append):
        digest_tensors([torch.ones(3), torch.ones(300, 300)], method="device")
        assert seen == [torch.device("cpu")]  # once per device per call, before any kernel
        digest_tensors([fake(torch.ones(5)), fake(torch.ones(70000))], method="xxh3")
        assert seen == [torch.device("cpu")] * 2  # the device of the copied tensors
    compat.synchronize(torch.device("cpu"))  # nothing to wait for on the CPU
    compat.synchronize(torch.device("meta"))  # nor on a device type without a synchronize


# -- 6: the device type is part of the structure -----------------------------------------------------


def _one_rank_on_another_device(rank: int, world: int) -> list[tuple[str, str, str | None]]:
    model = nn.Module()
    w = torch.arange(1000, dtype=torch.float32)
    model.register_buffer("w", fake(w, MetaAccel) if rank == 1 else w)
    result = Auditor(model, include=("buffers",), timeout_s=30).audit()
    return [(m.name, m.kind, m.detail) for m in result.mismatches]


def test_a_tensor_on_another_device_type_is_a_structure_mismatch_not_a_value_gap_of_zero() -> None:
    for got in run_ranks(_one_rank_on_another_device, 3):
        assert len(got) == 1
        name, kind, detail = got[0]
        assert (name, kind) == ("w", "structure")
        assert detail is not None and "device meta instead of cpu" in detail


# -- 7: first-use probe per device type --------------------------------------------------------------


@pytest.fixture
def probed_cpu() -> Any:
    """The CPU probed as if it were an accelerator, with a fresh probe record."""
    with mock.patch.object(D, "_PROBE_EXEMPT", set()), mock.patch.dict(D._probed, clear=True):
        yield


def _mixed() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(33, 7, generator=g).t(), torch.randint(0, 9, (13,), dtype=torch.int8), torch.randn(300000)]


def test_the_probe_passes_where_the_arithmetic_is_exact(probed_cpu: Any) -> None:
    ts = _mixed()
    assert digest_tensors(ts, method="device").tolist() == [reference(host_bytes(t)) for t in ts]
    assert D._probed == {"cpu": True}


@pytest.mark.parametrize("how", ["differs", "raises"])
def test_a_device_whose_probe_differs_or_raises_is_digested_on_the_host_with_the_same_digests(
    probed_cpu: Any, how: str
) -> None:
    ts = _mixed()
    expected = [reference(host_bytes(t)) for t in ts]
    broken = (
        mock.patch.object(D, "_PROBE_EXPECTED", [1, 2, 3])
        if how == "differs"
        else mock.patch.object(D, "_device_batch", side_effect=RuntimeError("no int64 here"))
    )
    with broken:
        assert not D.device_ok(torch.device("cpu"))
    # From now on this device type never runs the device kernels, and the digests do not change.
    with mock.patch.object(D, "_on_device", side_effect=AssertionError("device path used after a failed probe")):
        assert digest_tensors(ts, method="device").tolist() == expected


def test_a_device_type_without_readable_results_falls_back_to_host_chunks() -> None:
    t = torch.randn(70, 30)
    reset_copies()
    with mock.patch.dict(D._probed, clear=True):
        got = digest_tensors([fake(t, MetaAccel)], method="auto")[0]
        assert D._probed == {"meta": False}
    assert got == reference(host_bytes(t)) and 0 < COPIED["largest"] <= CHUNK


# -- 8: transfers and scratch ------------------------------------------------------------------------


class _HostData(TorchDispatchMode):
    """Counts tensors made from host data (each one a host-to-device copy on an accelerator) and scalar reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lifts = self.scalars = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        self.lifts += name.startswith("aten.lift_fresh")
        self.scalars += name.startswith("aten._local_scalar_dense")
        return func(*args, **(kwargs or {}))


def test_a_240_tensor_model_costs_one_host_to_device_copy_per_batch_and_one_copy_back() -> None:
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(n % 37 + 1, generator=g) for n in range(200)]  # whole words and padded sizes
    ts += [torch.randint(0, 9, (n + 1,), dtype=torch.int8) for n in range(30)]
    ts += [torch.randn(300000, generator=g)[n:] for n in range(10)]  # streamed: over 1 MiB
    backs: list[tuple[int, ...]] = []
    original = torch.Tensor.cpu

    def counting_cpu(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        backs.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "cpu", counting_cpu), _HostData() as seen:
        got = digest_tensors(ts, method="device")
    assert got.tolist() == [reference(host_bytes(t)) for t in ts]
    assert seen.lifts == 2  # one per batch (whole-word sizes, padded sizes), none per streamed tensor
    assert seen.scalars == 0 and backs == [(len(ts),)]


def test_scratch_halves_on_out_of_memory_until_it_fits_and_the_digest_does_not_change() -> None:
    t = torch.randn(50000, dtype=torch.float64)
    real = D._alloc

    def small_device(n: int, device: torch.device) -> torch.Tensor:
        if n > 2 * 3000:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real(n, device)

    with (
        mock.patch.object(D, "_alloc", small_device),
        mock.patch.object(D, "_MIN_WORDS", 64),
        mock.patch.dict(D._step_of, clear=True),
        mock.patch.object(D, "_DEVICE_BATCH_BYTES", -1),
    ):
        assert digest_tensors([t], method="device")[0] == reference(host_bytes(t))
        assert 1000 < D._step_of["cpu"] <= 3000  # halved from 50,000 words, and kept
        with mock.patch.object(D, "_MIN_WORDS", 4096):  # below the floor it gives up, loudly
            D._step_of.clear()
            with mock.patch.object(D, "_alloc", side_effect=torch.OutOfMemoryError("full")):
                with pytest.raises(torch.OutOfMemoryError):
                    digest_tensors([t], method="device")


def test_a_batch_that_does_not_fit_is_digested_one_tensor_at_a_time() -> None:
    ts = _mixed()[:2]
    with mock.patch.object(D, "_device_batch", side_effect=torch.OutOfMemoryError("batch")):
        assert digest_tensors(ts, method="device").tolist() == [reference(host_bytes(t)) for t in ts]
