"""Property-based tests of the digest and the decision functions (hypothesis).

- equal bytes give equal digests, in this process and in a freshly spawned one (other hash seed, other
  allocator state), whatever the memory layout;
- any single-bit change is found, by the CPU (xxh3) and the on-device digest alike;
- the reference is the largest group of equal values, a tie goes to the group holding the lowest rank,
  and reference and differing ranks partition the ranks, for any assignment of values to ranks.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync_audit.engine.agreement.consensus import compare_digest_table, judge_summaries, majority
from weightsync_audit.engine.hashing.device_digest import device_digests
from weightsync_audit.engine.hashing.digest import digest_tensor

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int64, torch.uint8, torch.bool]


@st.composite
def tensors(draw: Any) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=3))
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
    return t.reshape(shape).clone()


def _digest_in_child(payload: tuple[str, list[int], bytes]) -> int:
    dtype_name, shape, raw = payload
    dtype = getattr(torch, dtype_name)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
    return digest_tensor(t.reshape(shape))


@pytest.fixture(scope="module")
def other_process() -> Iterator[Any]:
    # spawn, not fork: a fresh interpreter with its own hash seed and allocator, as another rank would be.
    with mp.get_context("spawn").Pool(1) as pool:
        yield pool


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=tensors())
def test_equal_bytes_give_equal_digests_across_processes_and_layouts(t: torch.Tensor, other_process: Any) -> None:
    mine = digest_tensor(t)
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    theirs = other_process.apply(_digest_in_child, ((str(t.dtype).removeprefix("torch."), list(t.shape), raw),))
    assert mine == theirs
    # the same logical values in a transposed (non-contiguous) layout hash the same
    if t.dim() >= 2:
        assert digest_tensor(t.transpose(0, 1).contiguous().transpose(0, 1)) == mine


@settings(max_examples=200, deadline=None)
@given(t=tensors().filter(lambda t: t.numel() > 0), data=st.data())
def test_any_single_bit_change_is_found(t: torch.Tensor, data: Any) -> None:
    nbits = t.numel() * t.element_size() * 8
    bit = data.draw(st.integers(0, nbits - 1))
    flipped = t.clone()
    u8 = flipped.view(-1).view(torch.uint8)  # a view: writing it changes `flipped`
    u8[bit // 8] ^= 1 << (bit % 8)
    assert digest_tensor(flipped) != digest_tensor(t)
    assert device_digests([flipped])[0] != device_digests([t])[0]


@given(values=st.lists(st.integers(0, 3), min_size=1, max_size=16))
def test_majority_and_tie_rules_hold_for_any_assignment_of_values(values: list[int]) -> None:
    ref, other = majority(values)
    world = len(values)
    assert sorted(ref + other) == list(range(world)) and not set(ref) & set(other)
    assert ref == sorted(ref) and other == sorted(other)
    ref_value = values[ref[0]]
    assert all(values[r] == ref_value for r in ref) and all(values[r] != ref_value for r in other)
    counts = Counter(values)
    top = max(counts.values())
    assert len(ref) == top  # the largest group
    # tie: of the largest groups, the one holding the lowest rank
    assert ref[0] == min(min(i for i, v in enumerate(values) if v == val) for val, c in counts.items() if c == top)
    if world == 2 and values[0] != values[1]:
        assert (ref, other) == ([0], [1])


@given(table=st.lists(st.lists(st.integers(0, 2), min_size=3, max_size=3), min_size=1, max_size=8))
def test_per_tensor_verdict_is_the_majority_of_each_column(table: list[list[int]]) -> None:
    arr = np.array(table, dtype=np.int64)
    diffs = {d.uid: d for d in compare_digest_table(["a", "b", "c"], arr)}
    for j, uid in enumerate("abc"):
        col = arr[:, j].tolist()
        if len(set(col)) == 1:
            assert uid not in diffs
        else:
            ref, other = majority(col)
            assert (list(diffs[uid].reference_ranks), list(diffs[uid].ranks)) == (ref, other)


@given(world=st.integers(1, 8), field=st.sampled_from(["step", "epoch", "config", "slice"]), rank=st.data())
def test_summaries_differing_in_position_are_out_of_step_never_a_divergence(world: int, field: str, rank: Any) -> None:
    from weightsync_audit.engine.agreement.consensus import SUMMARY_FIELDS

    table = np.tile(np.arange(len(SUMMARY_FIELDS), dtype=np.int64), (world, 1))
    assert judge_summaries(table).status == "in_sync"
    if world > 1:
        r = rank.draw(st.integers(1, world - 1))
        table[r, SUMMARY_FIELDS.index(field)] += 1
        table[r, SUMMARY_FIELDS.index("overall")] += 1  # weights differ too: still not a divergence
        verdict = judge_summaries(table)
        assert verdict.status == "out_of_step" and field in verdict.differing_fields
