"""Attribution on 2 real gloo ranks (plain DDP + Adam, LoopAudit): each fault on rank 0 and on rank 1 is
blamed on the right rank with the right evidence, never by the tie rule; resync takes its source from the
blame on a tie; healthy runs carry no blame; records with and without ``blame`` read back."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from attribution_faults import ATTRIBUTION_FAULTS, FAULT_STEP, after_step, build, corrupting_hook, train_step
from ranks import run_ranks

from weightsync_audit import AuditResult, LoopAudit, read_report

STEPS = 6


def _loop(
    rank: int, world: int, fault: str | None, faulty: int, report: str | None, on_mismatch: str
) -> dict[str, Any]:
    _, ddp, opt = build(rank)
    audit = LoopAudit(ddp, opt, every_n_steps=1, on_mismatch=on_mismatch, report_path=report, verbose=False,
                      attribution=True)  # fmt: skip
    results = []
    for step in range(1, STEPS + 1):
        train_step(ddp, opt, rank, step, fault, faulty)
        r = audit.step(step)
        results.append(None if r is None else r.to_dict())
        after_step(ddp, rank, step, fault, faulty)
    audit.close()
    return {"records": results}


def _first_divergent(out: list[dict[str, Any]]) -> dict[str, Any]:
    recs = [r for r in out[0]["records"] if r and not r["in_sync"]]
    assert recs, "no divergence found"
    assert out[0]["records"] == out[1]["records"] or all(
        a["blame"] == b["blame"] for a, b in zip(recs, [r for r in out[1]["records"] if r and not r["in_sync"]])
    )
    return recs[0]


@pytest.mark.parametrize("faulty", [0, 1])
@pytest.mark.parametrize("fault", ["flip_at_rest", "update_ulp", "grad_after_reduce", "lr_one_rank"])
def test_the_faulty_rank_of_two_is_named_with_its_class(fault: str, faulty: int) -> None:
    out = run_ranks(_loop, 2, fault, faulty, None, "warn")
    first = _first_divergent(out)
    evidence, hardware = ATTRIBUTION_FAULTS[fault]
    blame = first["blame"]
    assert blame["ranks"] == [faulty], blame
    assert blame["evidence"] == evidence and blame["hardware_suspect"] is hardware, blame
    assert blame["step"] == FAULT_STEP, blame
    assert any(m["detail"] and "tie vote" in m["detail"] for m in first["mismatches"])  # the vote could not tell
    assert first["hints"][0].startswith(
        {"at_rest_change": "memory at rest", "update_not_reproducible": "compute in the step"}.get(
            evidence, "a software difference"
        )
    )
    assert str(faulty) in (first.get("hosts") or {})


def test_a_healthy_run_with_attribution_has_no_blame() -> None:
    out = run_ranks(_loop, 2, None, 0, None, "warn")
    assert all(r["in_sync"] and "blame" not in r for r in out[0]["records"] if r)


def _collective(rank: int, world: int, faulty: int, offload: bool = False) -> dict[str, Any]:
    from weightsync_audit import AttributionConfig, Auditor
    from weightsync_audit.engine.attribution.settle import attach_watch
    from weightsync_audit.engine.config import AuditConfig

    _, ddp, opt = build(rank)
    auditor = Auditor(ddp, opt, config=AuditConfig(attribution=AttributionConfig(collective=True, recheck=1)))
    hook = corrupting_hook(faulty, rank, FAULT_STEP)
    auditor.attribution = attach_watch(auditor, ddp, [opt], hook=hook, **({"offload": True} if offload else {}))
    out = []
    for step in range(1, STEPS + 1):
        train_step(ddp, opt, rank, step, None, faulty)
        auditor.attribution.mark(step)
        out.append(auditor.audit(step=step).to_dict())
    return {"records": out}


@pytest.mark.parametrize("offload", [False, True])
def test_the_collective_is_told_from_the_compute(offload: bool) -> None:
    """``offload`` (what ``overlap=True`` sets): the digests run on a worker after DDP's hook returns."""
    out = run_ranks(_collective, 2, 1, offload)
    first = _first_divergent(out)
    blame = first["blame"]
    assert blame["evidence"] == "collective_mismatch" and blame["step"] == FAULT_STEP, blame
    assert "all-reduce of bucket 0" in blame["detail"] and blame["ranks"] == []  # two ranks: no majority
    assert first["hints"][0].startswith("attribution undecided (the collective)")


@pytest.mark.parametrize("faulty", [0, 1])
def test_resync_on_a_tie_takes_its_source_from_the_blame(tmp_path: Path, faulty: int) -> None:
    report = tmp_path / "resync.jsonl"
    out = run_ranks(_loop, 2, "flip_at_rest", faulty, str(report), "resync")
    records = [r for _, r in read_report(report).records]
    fixed = [r for r in records if not r.in_sync]
    assert fixed and fixed[0].action == "resynced" and fixed[0].blame["ranks"] == [faulty]
    assert any(f"from rank {1 - faulty}" in n for n in fixed[0].notes), fixed[0].notes
    assert out[0]["records"][-1]["in_sync"]
    from rich.console import Console

    from weightsync_audit.cli.reports import cmd_show
    from weightsync_audit.reporting.terminal import check_report

    for cmd in (check_report, cmd_show):
        console = Console(file=io.StringIO(), width=10_000)
        cmd(str(report), console=console)
        said = console.file.getvalue()
        assert f"blame: rank {faulty} (memory at rest; evidence at_rest_change; HARDWARE SUSPECT)" in said, said


def test_a_record_without_blame_still_reads_and_a_bad_blame_is_named() -> None:
    r = AuditResult(in_sync=True, step=1).to_dict()
    assert AuditResult.from_dict(r).blame is None
    from weightsync_audit.errors import ReportFormatError

    bad = {**r, "in_sync": True, "blame": {"ranks": [0], "evidence": "guess", "hardware_suspect": True}}
    with pytest.raises(ReportFormatError, match="blame.evidence"):
        AuditResult.from_dict(bad)


def test_the_vote_alone_never_names_a_culprit_of_a_tie_and_a_strict_majority_names_the_odd_rank() -> None:
    from weightsync_audit import Mismatch
    from weightsync_audit.engine.attribution.blame import decide

    tie = Mismatch("w", "param", [1], [0], detail="tie vote: rank 0 vs rank 1, no majority")
    assert decide([{}, {}], [0, 1], [tie]).ranks == ()
    odd = Mismatch("w", "param", [2], [0, 1])
    assert decide([{}, {}, {}], [0, 1, 2], [odd]).as_dict() | {"detail": ""} == {
        "ranks": [2], "evidence": "vote", "cause": "unknown", "hardware_suspect": False, "step": None, "detail": ""
    }  # fmt: skip
    # Every rank changed at rest (code run everywhere between the steps), to other values: no one alone.
    recs = [{"records": [{"step": 3, "pre": p, "stepped": True, "rest": ["w"]}]} for p in (1, 2)]
    assert decide(recs, [0, 1], [tie]).ranks == ()


WIRE_KEYS = {"step", "seq", "stepped", "pre", "post", "rest", "rest_count", "rest_evidence", "rest_read", "hyper",
             "hyper_changed", "hyper_text", "grads", "grads_changed", "buckets", "update", "covered", "replayable",
             "too_large", "declined", "failed"}  # fmt: skip
"""Every key a step record's JSON has ever carried."""


def _typed(rank: int, world: int, offload: bool) -> dict[str, Any]:
    import json

    from weightsync_audit import AttributionConfig, Auditor
    from weightsync_audit.engine.attribution.records import StepRecord
    from weightsync_audit.engine.attribution.settle import attach_watch
    from weightsync_audit.engine.config import AuditConfig

    _, ddp, opt = build(rank)
    auditor = Auditor(ddp, opt, config=AuditConfig(attribution=AttributionConfig(collective=True, recheck=1)))
    watch = attach_watch(auditor, ddp, [opt], offload=offload)
    for step in range(1, STEPS + 1):
        train_step(ddp, opt, rank, step, None)
        watch.mark(step)
        after_step(ddp, rank, step, "flip_at_rest", 0)
    wire = json.loads(json.dumps(watch.payload()))["records"]
    typed = list(watch.records)
    watch.detach()
    return {"typed": [isinstance(r, StepRecord) and StepRecord.of(w) == r for r, w in zip(typed, wire)], "wire": wire}


@pytest.mark.parametrize("offload", [False, True])
def test_the_step_records_are_frozen_records_whose_json_reads_back_identically(offload: bool) -> None:
    """The watch writes :class:`StepRecord`s (``offload``: the workers' late fills seen by the payload), and
    their JSON, as exchanged, reads back into the same record and writes out the same JSON."""
    from weightsync_audit.engine.attribution.records import StepRecord

    out = run_ranks(_typed, 2, offload)
    for rank in (0, 1):
        wire = out[rank]["wire"]
        assert len(wire) == STEPS and out[rank]["typed"] == [True] * STEPS
        for w in wire:
            assert StepRecord.of(w).as_dict() == w and set(w) <= WIRE_KEYS, w
            assert {"step", "stepped", "post", "hyper", "grads", "buckets", "covered"} <= set(w), w  # late fills too
        flipped = wire[FAULT_STEP - 1]
        if rank == 0:
            assert flipped["rest"] == ["0.weight"] and flipped["rest_count"] == 1, flipped
            assert flipped["rest_evidence"][0] | {"max_abs": 0} == {"name": "0.weight", "numel": 128, "moved": False,
                                                                   "elements": 1, "compared": 128, "bits": 1, "max_abs": 0}  # fmt: skip
        else:
            assert "rest" not in flipped
    legacy = {"stepped": True, "step": 4, "seq": 1, "pre": 1, "post": -2, "rest": ["w", "v"], "rest_count": 9,
              "rest_evidence": [{"name": "w", "numel": 8000, "moved": False, "elements": 5000, "compared": 8000,
                                 "bits": None, "max_abs": 0.5}, {"name": "v", "numel": None, "moved": True}],
              "rest_read": "late", "hyper": 3, "hyper_changed": "lr 0.1 -> 0.2", "hyper_text": "0.0.lr=0.2", "grads": 5,
              "grads_changed": ["w"], "buckets": [[0, 7], [1, -8]], "update": ["w"], "covered": 1, "replayable": 2,
              "too_large": 1, "declined": "LBFGS", "failed": "collective check: boom"}  # fmt: skip
    assert StepRecord.of(legacy).as_dict() == legacy


def test_changes_are_counted_on_a_one_element_view_with_an_odd_stride() -> None:
    """Counting a change's elements and bits reads the bytes through the reader's one byte view: a single
    element whose stride is not 1 (contiguous by torch's rule) is counted, not left uncounted by an error."""
    import torch

    from weightsync_audit.engine.attribution.records import count_changes

    now = torch.arange(4.0)[1::3]
    before = now.clone()
    before.view(torch.int32)[0] ^= 1 << 3
    assert count_changes(now, before) == {"elements": 1, "compared": 1, "bits": 1, "max_abs": pytest.approx(2**-20)}
