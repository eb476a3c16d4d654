"""Every public error pickles and unpickles with its fields: raised in a spawned rank, a multiprocessing or
a Ray worker, it reaches the parent whole (issue 30, item 17)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
import torch
from ranks import run_ranks

import weightsync_audit as wa
from weightsync_audit import errors


def _divergent_result() -> wa.AuditResult:
    m = wa.Mismatch("fc.weight", "param", [1], [0], shape=[4, 4], dtype="float32", max_abs_diff=0.5)
    return wa.AuditResult(
        in_sync=False, step=7, epoch=None, world_size=2, mismatches=[m], hints=["a hint"], time="2026-12-03T00:00:00Z"
    )


def _samples() -> list[tuple[BaseException, dict[str, Any]]]:
    """One of each public error, with the fields it must keep."""
    result = _divergent_result()
    return [
        (errors.WeightSyncAuditError("base"), {}),
        (errors.WeightDivergenceError(result), {"result": result}),
        (errors.WeightDivergenceError(result, "custom words"), {"result": result}),
        (errors.AuditTimeoutError("rank 1 late", [1, 3]), {"missing_ranks": [1, 3]}),
        (
            errors.AuditOutOfStepError("out of step", {0: "step 3", 1: "step 4"}),
            {"positions": {0: "step 3", 1: "step 4"}},
        ),
        (errors.AuditPreparationError("prep", {1: "meta tensor"}), {"failures": {1: "meta tensor"}}),
        (
            errors.UnauditableTensorError("fc.weight", "it is a meta tensor"),
            {"name": "fc.weight", "why": "it is a meta tensor"},
        ),
        (errors.ReportFormatError("bad line", line=3, torn=True), {"line": 3, "torn": True}),
        (errors.ReportReadError("audit.jsonl: no such file"), {}),
        (errors.CheckpointError("ckpt.pt: not a checkpoint"), {}),
        (errors.UnsafeCheckpointError("ckpt.pt needs code to load; refused"), {}),
        (errors.TrainableSetMismatchError("flags", [2]), {"ranks": [2]}),
        (errors.AuditRaceError("written in the window", {1: "0.weight"}), {"raced": {1: "0.weight"}}),
        (
            errors.ResyncError("rank 1 died", 1, partial=["fc.weight"], untouched=["fc.bias"]),
            {"failed_rank": 1, "partial": ["fc.weight"], "untouched": ["fc.bias"]},
        ),
    ]


def _public_error_classes() -> set[type]:
    return {
        getattr(errors, n)
        for n in errors.__all__
        if isinstance(getattr(errors, n), type) and issubclass(getattr(errors, n), errors.WeightSyncAuditError)
    }


def _same(a: BaseException, b: BaseException, fields: dict[str, Any]) -> None:
    assert type(a) is type(b)
    assert str(a) == str(b)
    for k, v in fields.items():
        got = getattr(b, k)
        if isinstance(v, wa.AuditResult):
            assert got.to_dict() == v.to_dict()
        else:
            assert got == v, k


def test_every_public_error_is_sampled() -> None:
    assert {type(e) for e, _ in _samples()} == _public_error_classes()


def test_every_public_error_round_trips_through_pickle_with_its_fields() -> None:
    for err, fields in _samples():
        err.add_note("a note added on the way")
        back = pickle.loads(pickle.dumps(err))
        _same(err, back, fields)
        assert back.__notes__ == ["a note added on the way"]


def _raise(i: int) -> None:
    raise _samples()[i][0]


def test_errors_raised_in_a_spawned_process_reach_the_parent_whole() -> None:
    samples = _samples()
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_raise, i) for i in range(len(samples))]
        for (err, fields), fut in zip(samples, futures):
            got = fut.exception(timeout=120)
            assert got is not None
            _same(err, got, fields)


def _real_divergence(rank: int, world: int) -> bytes:
    model = torch.nn.Linear(4, 4)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
        if rank == 1:
            model.weight[0, 0] += 1.0
    audit = wa.LoopAudit(model, every_n_steps=1, on_mismatch="raise", verbose=False)
    try:
        audit.audit(1)
    except wa.WeightDivergenceError as exc:
        return pickle.dumps(exc)
    finally:
        audit.close()
    raise AssertionError("no divergence raised")


def test_a_real_divergence_error_from_a_gloo_rank_unpickles_with_its_result() -> None:
    for rank, payload in enumerate(run_ranks(_real_divergence, 2)):
        exc = pickle.loads(payload)
        assert isinstance(exc, wa.WeightDivergenceError)
        assert exc.result.diverged_names == ["weight"], rank
        assert exc.result.mismatches[0].ranks == [1]
        assert "weight" in str(exc)


def test_without_reduce_the_fields_would_be_lost() -> None:
    """The failure this guards against: Exception's default pickling calls the class with ``args`` only."""
    err = errors.ResyncError("rank 1 died", 1, partial=["a"])
    state = Exception.__reduce__(err)
    with pytest.raises(TypeError):
        state[0](*state[1])


class _NewFieldError(errors.AuditTimeoutError):
    """A subclass with a field of its own and no ``_init_args``: rebuilt from its signature all the same."""

    def __init__(self, message: str, missing_ranks: list[int], hint: str = "") -> None:
        self.hint = hint
        super().__init__(message, missing_ranks)


def test_a_field_named_in_the_signature_pickles_without_restating_it() -> None:
    exc = _NewFieldError("late", [1], hint="check rank 1")
    back = pickle.loads(pickle.dumps(exc))
    _same(exc, back, {"missing_ranks": [1], "hint": "check rank 1"})
    assert exc._init_args() == ("late", [1], "check rank 1")
