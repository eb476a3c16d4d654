"""Sampled audits (``coverage=1/n``): each audit hashes a rotating, rank-consistent slice of every large
tensor; ``n`` consecutive audits cover every element exactly once; a change is found exactly when the
slice holding it comes round; ranks that disagree on the sampling are told so, not shown a divergence."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ranks import run_ranks
from torch import nn

from weightsync_audit import Auditor, AuditOutOfStepError
from weightsync_audit.engine.config import parse_coverage
from weightsync_audit.engine.hashing.digest import digest_tensor
from weightsync_audit.engine.hashing.reader import SAMPLE_ALIGN, SMALL, sample_bounds, sample_pieces


@given(numel=st.integers(0, 50_000), slices=st.integers(1, 40))
@settings(max_examples=200, deadline=None)
def test_slices_are_disjoint_aligned_and_cover_every_element(numel: int, slices: int) -> None:
    bounds = [sample_bounds(numel, i, slices) for i in range(slices)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (a, b), (c, _) in itertools.pairwise(bounds):
        assert a <= b == c
    assert all(a % SAMPLE_ALIGN == 0 for a, _ in bounds)
    assert sample_bounds(numel, slices + 3, slices) == bounds[3 % slices]  # the index wraps around


@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    slices=st.integers(2, 9),
    index=st.integers(0, 8),
)
@settings(max_examples=60, deadline=None)
def test_pieces_are_views_that_spell_the_flat_slice_in_any_layout(
    shape: tuple[int, ...], slices: int, index: int
) -> None:
    t = torch.arange(int(torch.tensor(shape).prod()) * 40, dtype=torch.float64)[
        : int(torch.tensor(shape).prod())
    ].reshape(shape)
    if t.dim() >= 2:
        t = t.t().contiguous().t() if t.dim() == 2 else t.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("weightsync_audit.engine.hashing.reader.SMALL", 0)
        pieces = sample_pieces(t, index, slices)
    a, b = sample_bounds(t.numel(), index, slices)
    got = torch.cat([p.reshape(-1) for p in pieces]) if pieces else torch.empty(0, dtype=t.dtype)
    assert got.tolist() == t.reshape(-1)[a:b].tolist()
    storage = t.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == storage for p in pieces if p.numel()), "a piece was copied"


@pytest.mark.parametrize("method", ["xxh3", "device"])
def test_a_slice_digest_does_not_depend_on_layout(method: str) -> None:
    t = torch.randn(300, 70)  # 84 KB: sampled
    assert t.nbytes > SMALL
    twin = t.t().contiguous().t()
    for i in range(5):
        assert digest_tensor(t, slice_index=i, slices=5, method=method) == digest_tensor(
            twin, slice_index=i, slices=5, method=method
        )


@pytest.mark.parametrize("method", ["xxh3", "device"])
def test_slices_spanning_several_leaves_do_not_depend_on_layout(method: str) -> None:
    t = torch.randn(64, 50, dtype=torch.float64)
    twin = t.t().contiguous().t()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("weightsync_audit.engine.hashing.digest.CHUNK", 1000)  # slices of ~6 KB: several leaves each
        mp.setattr("weightsync_audit.engine.hashing.digest.SMALL", 0)
        mp.setattr("weightsync_audit.engine.hashing.reader.SMALL", 0)
        for i in range(4):
            a = digest_tensor(t, slice_index=i, slices=4, method=method)
            assert a == digest_tensor(twin, slice_index=i, slices=4, method=method)
            start, stop = sample_bounds(t.numel(), i, 4)
            assert a == digest_tensor(t.reshape(-1)[start:stop].clone(), method=method)


@pytest.mark.parametrize("method", ["xxh3", "device"])
def test_more_slices_than_aligned_runs_leaves_some_slices_empty_and_still_works(method: str) -> None:
    t = torch.randn(5000, 4).t()  # 80 KB, non-contiguous
    empty = digest_tensor(torch.empty(0), method=method)
    digests = [digest_tensor(t, slice_index=i, slices=1000, method=method) for i in range(1000)]
    assert digests.count(empty) == 1000 - len(range(0, t.numel(), SAMPLE_ALIGN))
    assert len(set(digests) - {empty}) == len(range(0, t.numel(), SAMPLE_ALIGN))


def test_small_tensors_are_whole_in_every_slice() -> None:
    t = torch.randn(100)
    assert {digest_tensor(t, slice_index=i, slices=8) for i in range(8)} == {digest_tensor(t)}


@pytest.mark.parametrize("coverage,slices", [(1, 1), ("1/8", 8), (0.125, 8), ("0.25", 4), (1 / 3, 3)])
def test_coverage_spellings(coverage: Any, slices: int) -> None:
    assert parse_coverage(coverage) == slices


@pytest.mark.parametrize("coverage", [0, 2, "3/8", 0.3, "nan", -1])
def test_coverage_that_is_not_one_over_n_is_refused(coverage: Any) -> None:
    with pytest.raises(ValueError, match="coverage"):
        parse_coverage(coverage)


SLICES = 4


def _big_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 4))  # 128 KB weight (sampled), small rest


def _planted(rank: int, world: int, element: int) -> list[tuple[bool, list[str], str | None]]:
    model = _big_model()
    auditor = Auditor(model, coverage=f"1/{SLICES}")
    if rank == 1:
        with torch.no_grad():
            model[0].weight.view(-1)[element] += 1.0
    out = []
    for step in range(2 * SLICES):
        r = auditor.audit(step=step)
        out.append((r.in_sync, r.diverged_names, r.coverage))
    return out


@pytest.mark.parametrize("k", range(SLICES))
def test_a_change_in_slice_k_is_found_exactly_when_slice_k_is_audited(k: int) -> None:
    numel = 128 * 256
    a, b = sample_bounds(numel, k, SLICES)
    element = (a + b) // 2
    r0, r1 = run_ranks(_planted, 2, element)
    assert r0 == r1, "ranks must agree on every audit"
    found = [i for i, (ok, _, _) in enumerate(r0) if not ok]
    assert found == [k, k + SLICES]
    assert all(names == ["0.weight"] for ok, names, _ in r0 if not ok)
    assert [c for _, _, c in r0] == [f"{i % SLICES + 1}/{SLICES}" for i in range(2 * SLICES)]


def _small_change(rank: int, world: int) -> list[bool]:
    model = _big_model()
    auditor = Auditor(model, coverage=f"1/{SLICES}")
    if rank == 1:
        with torch.no_grad():
            model[1].bias[0] += 1.0  # a small tensor: hashed whole in every slice
    return [auditor.audit(step=s).in_sync for s in range(SLICES)]


def test_a_change_in_a_small_tensor_is_found_at_once() -> None:
    assert run_ranks(_small_change, 2) == [[False] * SLICES] * 2


def _out_of_step(rank: int, world: int, how: str) -> str:
    """``coverage``: rank 0 audits 1/8 of the model, rank 1 1/4; ``history``: rank 1's auditor was restored from
    a checkpoint taken one audit later, so its slice is the next one. The message of the audit's error."""
    model = _big_model()
    auditor = Auditor(model, coverage="1/8" if how == "coverage" and rank == 0 else "1/4", timeout_s=20)
    if how == "history" and rank == 1:
        auditor.history.load_state_dict({"audits": 1})
    try:
        auditor.audit(step=0)
    except AuditOutOfStepError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("how", "named"),
    [("coverage", ("1/8", "1/4")), ("history", ("slice",))],
    ids=["different coverage", "different slices"],
)
def test_ranks_out_of_step_are_not_diverged(how: str, named: tuple[str, ...]) -> None:
    msgs = run_ranks(_out_of_step, 2, how)
    assert all(m != "no error" for m in msgs), msgs
    assert all(all(word in m for word in named) for m in msgs), msgs
