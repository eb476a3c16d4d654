"""``check_finite`` counts what can be counted and names what cannot (issue 30, item 5): one dtype with no
sum on this device (float8 on the CPU) never throws the other tensors' counts away."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ranks import run_ranks

from weightsync_audit import Auditor, audit
from weightsync_audit.engine.measure.finite import count_nonfinite

F8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
pytestmark = pytest.mark.skipif(not F8, reason="this torch has no float8 dtypes")


def _model(nan_in_f8: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    for i, dt in enumerate(F8):
        vals = torch.linspace(-2, 2, 40)
        if nan_in_f8 and i == 0:
            vals[3] = float("nan")
        m[0].register_buffer(f"scale{i}", vals.to(dt))
    with torch.no_grad():
        m[1].weight[0, 1] = float("nan")
    return m


def _truth(m: torch.nn.Module) -> int:
    """Tensors holding NaN/inf, read by the test itself: every tensor widened to float64."""
    ts = [*m.parameters(), *m.buffers()]
    return sum(1 for t in ts if not torch.isfinite(t.detach().to(torch.float64)).all())


def test_count_nonfinite_reads_float8_and_complex32_in_widened_pieces() -> None:
    for dt in F8:
        t = torch.tensor([1.0, float("nan"), 2.0] * 1000).to(dt)
        assert count_nonfinite(t) == 1000 == int(torch.isnan(t.float()).sum())
    c = torch.tensor([1 + 1j, complex(float("inf"), 0)], dtype=torch.complex64).to(torch.complex32)
    assert count_nonfinite(c) == 1


def test_a_nan_weight_beside_a_float8_buffer_is_counted() -> None:
    """The issue's case: the float8 buffer used to make the count 0."""
    for nan_in_f8 in (False, True):
        m = _model(nan_in_f8)
        r = audit(m, check_finite=True)
        assert r.nonfinite_count == _truth(m) == 1 + nan_in_f8
        assert any("1.weight" in n for n in r.notes), r.notes
        if nan_in_f8:
            assert any("0.scale0" in n for n in r.notes), r.notes


def _cached(rank: int, world: int) -> list[Any]:
    m = _model(nan_in_f8=True)
    auditor = Auditor(m, check_finite=True)
    return [(r.in_sync, r.nonfinite_count, r.notes) for r in (auditor.audit(step=s) for s in range(3))] + [_truth(m)]


def test_two_ranks_count_float8_nan_on_the_first_and_the_cached_audits() -> None:
    for got in run_ranks(_cached, 2):
        *records, truth = got
        assert truth == 2
        for in_sync, count, notes in records:
            assert in_sync and count == truth, (count, notes)
            assert not any("not counted" in n for n in notes), notes


class _NoKernels(torch.Tensor):
    """A tensor on a device that has no kernel to read its dtype (sum, isfinite and widening all fail)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in ("sum", "isfinite", "to", "cat", "float"):
            raise NotImplementedError(f"{name} not implemented for this device")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_that_cannot_be_read_is_named_and_never_hides_the_others() -> None:
    from weightsync_audit.engine.measure.finite import NonfiniteCount, screen_nonfinite

    nan = torch.tensor([1.0, float("nan")])
    odd = torch.zeros(4, dtype=F8[0]).as_subclass(_NoKernels)
    small_f32 = torch.ones(3)
    found, uncounted = screen_nonfinite([small_f32, odd, nan, torch.arange(3)])
    assert found == [2] and uncounted == [1]
    notes = NonfiniteCount(1, ["w"], uncounted=1, uncounted_names=["s float8_e4m3fn on cpu"]).notes(True)
    assert "NaN/inf not counted in 1 tensor(s) (s float8_e4m3fn on cpu)" in notes[1]
