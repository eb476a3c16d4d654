"""The decision functions, without processes: pure functions of gathered tables."""

from __future__ import annotations

import numpy as np
import pytest

from weightsync_audit.engine.agreement.consensus import (
    PROTOCOL,
    compare_digest_table,
    compare_manifests,
    judge_summaries,
    majority,
)


def summary(
    step: int = 5, structure: int = 11, overall: int = 22, config: int = 33, count: int = 4, slice_: int = 0
) -> list[int]:
    return [PROTOCOL, step, 0, count, structure, overall, config, slice_]


def test_equal_summaries_are_in_sync() -> None:
    assert judge_summaries(np.array([summary()] * 4)).status == "in_sync"


def test_a_different_overall_digest_asks_for_per_tensor_digests() -> None:
    v = judge_summaries(np.array([summary(), summary(overall=23)]))
    assert (v.status, v.differing_fields) == ("values", ("overall",))


@pytest.mark.parametrize("field,kwargs", [("structure", {"structure": 12}), ("count", {"count": 5})])
def test_a_different_structure_or_count_asks_for_manifests(field: str, kwargs: dict) -> None:
    v = judge_summaries(np.array([summary(), summary(**kwargs), summary()]))
    assert v.status == "structure" and field in v.differing_fields


@pytest.mark.parametrize("kwargs,field", [({"step": 6}, "step"), ({"config": 34}, "config"), ({"slice_": 1}, "slice")])
def test_different_positions_are_out_of_step_even_when_values_differ_too(kwargs: dict, field: str) -> None:
    v = judge_summaries(np.array([summary(), summary(overall=99, **kwargs)]))
    assert v.status == "out_of_step" and v.differing_fields == (field,)


def test_majority_picks_the_largest_group() -> None:
    assert majority(["a", "a", "b", "a"]) == ([0, 1, 3], [2])
    assert majority(["b", "a", "a", "a"]) == ([1, 2, 3], [0])


def test_majority_tie_goes_to_the_group_holding_the_lowest_rank() -> None:
    assert majority(["x", "y"]) == ([0], [1])
    assert majority(["y", "x", "x", "y"]) == ([0, 3], [1, 2])
    assert majority(["p", "q", "r"]) == ([0], [1, 2])
    assert majority(["q", "p", "p", "q", "r"]) == ([0, 3], [1, 2, 4])


def test_digest_table_names_each_differing_tensor_and_its_odd_ranks() -> None:
    table = np.array([[1, 2, 3], [1, 2, 3], [1, 9, 3], [1, 2, 8]], dtype=np.int64)
    diffs = compare_digest_table(["p:a", "p:b", "p:c"], table)
    assert [(d.uid, d.reference_ranks, d.ranks) for d in diffs] == [("p:b", (0, 1, 3), (2,)), ("p:c", (0, 1, 2), (3,))]


def test_identical_digest_tables_have_no_differences() -> None:
    assert compare_digest_table(["a"], np.array([[5], [5]])) == []
    assert compare_digest_table([], np.zeros((2, 0), dtype=np.int64)) == []


def test_manifests_report_missing_extra_and_reshaped_tensors_and_still_compare_the_rest() -> None:
    r0 = [["param", "w", "float32", [2, 2], 1], ["param", "b", "float32", [2], 2], ["buffer", "s", "float32", [3], 3]]
    r1 = [["param", "w", "float32", [2, 2], 7], ["buffer", "s", "float64", [3], 3], ["param", "x", "float32", [1], 4]]
    r2 = [["param", "w", "float32", [2, 2], 1], ["param", "b", "float32", [2], 2], ["buffer", "s", "float32", [3], 3]]
    structure, values = compare_manifests([r0, r1, r2])
    by = {d.name: d for d in structure}
    assert by["b"].ranks == (1,) and "missing on rank 1" in by["b"].detail
    assert by["s"].ranks == (1,) and "dtype float64 instead of float32 on rank 1" in by["s"].detail
    assert by["x"].reference_ranks == (0, 2) and "present only on rank 1" in by["x"].detail
    assert [(v.uid, v.ranks) for v in values] == [("param:w", (1,))]


def test_the_decision_is_the_same_whichever_rank_computes_it() -> None:
    # Every rank receives the same gathered table; the verdict is a function of it alone.
    table = np.array([summary(), summary(overall=1), summary(overall=2)])
    assert judge_summaries(table.copy()) == judge_summaries(table.copy())
