"""The data plane on real gloo ranks: gaps measured from owned memory, in chunks, within bounded
memory and a time bound that grows with the bytes; best effort when a transfer fails."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest
import torch
from harness import peak_extra_bytes
from ranks import RankDied, run_ranks
from torch import nn

from weightsync_audit import Auditor, audit
from weightsync_audit.compat import default_store
from weightsync_audit.engine.hashing.digest import digest_tensors
from weightsync_audit.text import without_tie


class FakeDevice(torch.Tensor):
    """Stands in for an accelerator tensor: not on the CPU, and ``.cpu()`` / ``.to("cpu")`` return a
    fresh host copy (a temporary, as a real device copy is)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.is_cpu:
            return False
        if func in (torch.Tensor.cpu, torch.Tensor.to):
            with torch._C.DisableTorchFunctionSubclass():
                plain = args[0].as_subclass(torch.Tensor)
                return func(plain, *args[1:], **kwargs).clone()
        return super().__torch_function__(func, types, args, kwargs)


def _weights_plus_half(rank: int, world: int, layout: str) -> list[tuple[str, float | None, str | None]]:
    torch.manual_seed(0)
    if layout == "channels_last":
        model: nn.Module = nn.Conv2d(64, 64, 3).to(memory_format=torch.channels_last)
    elif layout == "one_strided_element":  # contiguous by torch's rule, yet no dtype view of it has stride 1
        model = nn.Module()
        model.weight = nn.Parameter(torch.arange(4.0)[1::3])
    else:
        model = nn.Linear(96, 64)
        with torch.no_grad():  # a transposed (non-contiguous) weight
            model.weight = nn.Parameter(torch.randn(96, 64).t())
    if rank == 1:
        with torch.no_grad():
            model.weight += 0.5
    result = audit(model, include=("params",), timeout_s=30)
    return [(m.name, m.max_abs_diff, without_tie(m.detail)) for m in result.mismatches]


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "one_strided_element"])
def test_non_contiguous_weight_shifted_by_half_reports_a_gap_of_half_on_every_rank(layout: str) -> None:
    for got in run_ranks(_weights_plus_half, 2, layout):
        assert len(got) == 1
        name, diff, detail = got[0]
        assert name == "weight" and detail is None
        assert diff == pytest.approx(0.5, abs=1e-6)


def _fake_device(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    host = torch.randn(300, 70)
    bf16 = torch.randn(33, 5).to(torch.bfloat16)
    if rank == 1:
        host[7, 3] += 0.25
    fake = host.as_subclass(FakeDevice)
    assert not fake.is_cpu
    methods = ("xxh3", "device", "auto")
    digests = {m: list(digest_tensors([fake, bf16.t().as_subclass(FakeDevice)], method=m)) for m in methods}
    plain = {m: list(digest_tensors([host, bf16.t()], method=m)) for m in methods}
    model = nn.Module()
    model.register_buffer("w", fake)
    result = audit(model, include=("buffers",), timeout_s=30, method="xxh3")
    # "auto" digests an accelerator tensor on its device: the same value as "device" on the host copy.
    same = digests["xxh3"] == plain["xxh3"] and digests["device"] == plain["device"] == digests["auto"]
    return {"same": same, "mismatches": [(m.name, m.max_abs_diff) for m in result.mismatches]}


def test_simulated_accelerator_tensor_digests_and_gap_are_right_and_do_not_crash() -> None:
    for got in run_ranks(_fake_device, 2):
        assert got["same"]
        assert len(got["mismatches"]) == 1
        assert got["mismatches"][0][1] == pytest.approx(0.25, abs=1e-6)


def _big_divergence(rank: int, world: int, mib: int) -> dict[str, Any]:
    t = torch.zeros(mib << 18)  # float32: mib MiB
    t[12345] = 1.0
    if rank == 1:
        t[len(t) - 7] = -2.5
    model = nn.Module()
    model.register_buffer("big", t)
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        result = audit(model, include=("buffers",), timeout_s=10)
        out["seconds"] = time.monotonic() - t0
        out["gaps"] = [(m.name, m.max_abs_diff, without_tie(m.detail)) for m in result.mismatches]

    out["extra"] = peak_extra_bytes(run)
    return out


def test_256_mib_divergence_gets_its_gap_on_both_ranks_without_timeout_in_bounded_memory() -> None:
    # The old path (the copy through the coordinator, float64 copies of both) peaked at 3.9 GiB per rank.
    for got in run_ranks(_big_divergence, 2, 256, timeout=120):
        assert got["gaps"] == [("big", 2.5, None)]
        if got["extra"] is not None:
            assert got["extra"] < 64 << 20, f"{got['extra'] / 2**20:.0f} MiB extra for a 256 MiB tensor"


def _resync_source_fails(rank: int, world: int, how: str) -> dict[str, Any]:
    from weightsync_audit import ResyncError, resync
    from weightsync_audit.channel.dataplane import DataPlane

    torch.manual_seed(rank)  # every rank holds its own values
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))  # 16 MiB in all
    src = 1
    if rank == src:
        sent = DataPlane.send

        def send_then_fail(self: DataPlane, *args: Any, **kwargs: Any) -> Any:
            out = sent(self, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            return out

        DataPlane.send = send_then_fail  # type: ignore[method-assign]
        default_store().set("source_pid", str(os.getpid()))
    t0 = time.monotonic()
    try:
        resync(model, src=src, timeout_s=3)
    except ResyncError as exc:
        return {
            "seconds": time.monotonic() - t0,
            "failed": exc.failed_rank,
            "message": str(exc),
            "partial": exc.partial,
        }
    finally:
        if rank != src and how == "stop":  # the stopped source is ended by its peer once that one is done
            os.kill(int(default_store().get("source_pid")), signal.SIGKILL)
    return {"seconds": time.monotonic() - t0, "failed": None}


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_resync_whose_source_dies_or_stops_raises_resync_error_naming_it_within_the_deadline(how: str) -> None:
    results = run_ranks(_resync_source_fails, 2, how, may_die=[1], timeout=60)
    assert isinstance(results[1], RankDied)
    got = results[0]
    assert got["failed"] == 1, got
    assert "rank 1 failed" in got["message"] and "may be left partial: 0.weight" in got["message"]
    assert got["partial"] == ["0.weight"]
    # timeout_s=3, grace 5 s: the chunks' deadline, then the closing exchange's; a kill is seen at once.
    assert got["seconds"] < (3 if how == "kill" else 3 + 2 * 5 + 3), got


def _gap_transfer_fails(rank: int, world: int) -> list[Any]:
    from weightsync_audit.channel.dataplane import DataPlane
    from weightsync_audit.channel.star import Comm

    model = nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.fill_(1.0 if rank == 0 else 1.25)
    auditor = Auditor(model, include=("params",), timeout_s=5)
    auditor._comm = Comm(None, 5, grace_s=1.0)
    sent = DataPlane.send
    if rank == 0:

        def late_send(self: DataPlane, *args: Any, **kwargs: Any) -> Any:
            time.sleep(2.5)  # past the chunk's deadline (1 s grace + its bytes at 32 MiB/s)
            return sent(self, *args, **kwargs)

        DataPlane.send = late_send  # type: ignore[method-assign]
    out = []
    first = auditor.audit(step=1)
    DataPlane.send = sent  # type: ignore[method-assign]
    out.append([(m.name, m.max_abs_diff, without_tie(m.detail)) for m in first.mismatches])
    second = auditor.audit(step=2)  # a fresh data plane: measured again
    out.append([(m.name, m.max_abs_diff, without_tie(m.detail)) for m in second.mismatches])
    auditor.config.gap_budget_s = 0.5  # less than the grace alone: nothing fits
    third = auditor.audit(step=3)
    out.append([(m.name, m.max_abs_diff, without_tie(m.detail)) for m in third.mismatches])
    return out


def test_a_gap_transfer_that_fails_leaves_gap_not_measured_on_every_rank_and_the_next_audit_measures_again() -> None:
    ranks = run_ranks(_gap_transfer_fails, 2, timeout=60)
    assert ranks[0] == ranks[1], "every rank returns the same record"
    first, second, third = ranks[0]
    assert [(n, d) for n, d, _ in first] == [("weight", None)]
    assert re.fullmatch(
        r"gap not measured: the \w+ between rank [01] and rank [01] (ran past its deadline|failed)", first[0][2]
    )
    assert second == [("weight", 0.25, None)]
    assert third[0][1] is None and third[0][2].startswith("gap not measured: ") and "gap_budget_s=0.5" in third[0][2]


def _reference_killed_mid_transfer(rank: int, world: int) -> dict[str, Any]:
    from weightsync_audit import AuditTimeoutError
    from weightsync_audit.channel.dataplane import DataPlane

    t = torch.zeros(16 << 18)  # 16 MiB: four chunks
    if rank == 2:
        t[3] = 1.0  # ranks 0 and 1 hold the reference; rank 0 sends it to rank 2
    model = nn.Module()
    model.register_buffer("w", t)
    if rank == 0:
        sent = DataPlane.send

        def send_then_die(self: DataPlane, *args: Any, **kwargs: Any) -> Any:
            out = sent(self, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
            return out

        DataPlane.send = send_then_die  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        audit(model, include=("buffers",), timeout_s=5)
    except AuditTimeoutError as exc:
        return {"seconds": time.monotonic() - t0, "missing": exc.missing_ranks}
    return {"seconds": time.monotonic() - t0, "missing": None}


def test_the_coordinator_killed_while_it_sends_a_reference_copy_is_named_by_every_survivor_at_once() -> None:
    results = run_ranks(_reference_killed_mid_transfer, 3, may_die=[0], timeout=60)
    assert isinstance(results[0], RankDied)
    for got in results[1:]:
        assert got["missing"] == [0], got
        assert got["seconds"] < 5, got  # a closed connection, not a deadline
