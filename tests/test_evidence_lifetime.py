"""A blame lives as long as its evidence explains the mismatches, on real gloo ranks (plain DDP + Adam,
LoopAudit with attribution): a divergence that persists (a drift within tolerance), then a second fault on
another rank, is decided afresh; the resync copies from the healthy rank and the evict file names the
flipped one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from attribution_faults import build, flip_bit, train_step
from ranks import RankDied, run_ranks

from weightsync_audit import LoopAudit
from weightsync_audit.integrations.evict import EVICT_FILE_ENV, read_evict

DRIFT_AFTER, FLIP_AFTER, STEPS = 2, 4, 6


def _drift(p: torch.Tensor) -> None:
    """A drift within tolerance, spread over every element (a write at rest on one rank)."""
    with torch.no_grad():
        p.mul_(1 + 1e-6)


def _persisting_then_flip(
    rank: int, world: int, drifting: int, flipped: int | None, on_mismatch: str, evict: str | None,
    report: str | None = None, tolerance: float | None = 1e-4,
) -> dict[str, Any]:  # fmt: skip
    if evict is not None:
        os.environ[EVICT_FILE_ENV] = evict
    _, ddp, opt = build(rank)
    audit = LoopAudit(ddp, opt, every_n_steps=1, on_mismatch=on_mismatch, verbose=False, attribution=True,
                      tolerance=tolerance, exit_code=17 if on_mismatch == "raise" else None, overlap=report is not None,
                      report_path=report)  # fmt: skip
    params = list(ddp.parameters())
    records: list[dict[str, Any] | None] = []
    for step in range(1, STEPS + 1):
        train_step(ddp, opt, rank, step, None)
        r = audit.step(step)  # with exit_code: every rank exits 17 at the flip's audit
        records.append(None if r is None else r.to_dict())
        if step == DRIFT_AFTER and rank == drifting:
            _drift(params[2]) if tolerance else flip_bit(params[2], 3, 29)
        if step == FLIP_AFTER and rank == flipped:
            flip_bit(params[0], 5, 27)
    audit.close()
    return {"records": records, "w0": params[0].detach().clone()}


def _divergent(records: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    return [r for r in records if r is not None and not r["in_sync"]]


def test_a_flip_while_a_tolerated_drift_persists_is_blamed_afresh_and_repaired_from_the_healthy_rank() -> None:
    out = run_ranks(_persisting_then_flip, 2, 1, 0, "resync", None)
    divergent = _divergent(out[0]["records"])
    first = divergent[0]
    assert first["blame"]["ranks"] == [1] and first["blame"]["step"] == DRIFT_AFTER + 1, first["blame"]
    flipped = next(r for r in divergent if any(m["name"].endswith("0.weight") for m in r["mismatches"]))
    assert flipped["blame"]["ranks"] == [0], flipped["blame"]  # decided afresh, not "decided at step 3"
    assert flipped["blame"]["evidence"] == "at_rest_change" and flipped["blame"]["hardware_suspect"]
    assert flipped["action"] == "resynced"
    # the repair copied rank 1's healthy weight over rank 0's flipped one (never the other way)
    assert torch.equal(out[0]["w0"], out[1]["w0"])
    assert not any(
        m["name"].endswith("0.weight") for r in out[0]["records"][FLIP_AFTER + 1 :] if r for m in r["mismatches"]
    )


def test_with_overlap_the_flip_is_blamed_afresh_and_repaired_from_the_healthy_rank(tmp_path: Path) -> None:
    from weightsync_audit import read_report

    out = run_ranks(_persisting_then_flip, 2, 1, 0, "resync", None, str(tmp_path / "r.jsonl"))
    divergent = [r for _, r in read_report(tmp_path / "r.jsonl").records if not r.in_sync]
    assert divergent[0].blame is not None and divergent[0].blame["ranks"] == [1]
    flipped = next(r for r in divergent if any(m.name == "0.weight" for m in r.mismatches))
    assert flipped.blame is not None and flipped.blame["ranks"] == [0], flipped.blame
    assert flipped.action == "resynced" and torch.equal(out[0]["w0"], out[1]["w0"])


def _drift_and_flip_in_one_audit(rank: int, world: int, drifting: int, flipped: int) -> dict[str, Any]:
    """The drift at rest before step 3's optimizer step, the flip of the same tensor after it: one audit (step
    3's) is the first to see either, holding the drifting rank's step record and the flipped rank's own check
    since the step (what an overlapped read racing the flip sees, made deterministic)."""
    _, ddp, opt = build(rank)
    audit = LoopAudit(ddp, opt, every_n_steps=1, on_mismatch="resync", verbose=False, attribution=True,
                      tolerance=1e-4)  # fmt: skip
    w2 = list(ddp.parameters())[2]
    records, kept = [], {}
    for step in range(1, 5):
        train_step(ddp, opt, rank, step, None)
        if step == 3 and rank == flipped:
            flip_bit(w2, 11, 28)
        kept[step] = w2.detach().clone()
        r = audit.step(step)
        records.append(None if r is None else r.to_dict())
        kept[-step] = w2.detach().clone()
        if step == 2 and rank == drifting:
            _drift(w2)
    audit.close()
    return {"records": records, "before": kept[3], "after": kept[-3]}


def test_two_changes_at_rest_in_one_audit_blame_the_one_that_made_the_gap_not_the_tolerated_drift() -> None:
    for world, drifting, flipped in ((2, 1, 0), (3, 0, 2)):
        out = run_ranks(_drift_and_flip_in_one_audit, world, drifting, flipped)
        first = _divergent(out[0]["records"])[0]
        assert first["step"] == 3 and first["blame"]["ranks"] == [flipped], (world, first["blame"])
        assert first["blame"]["evidence"] == "at_rest_change" and first["action"] == "resynced", first["blame"]
        assert all(o["records"][2]["blame"] == first["blame"] for o in out)
        # repaired from a rank that was not flipped, never the flipped weight over a healthy rank
        assert all(torch.equal(o["after"], out[0]["after"]) for o in out)
        assert any(torch.equal(out[0]["after"], o["before"]) for r, o in enumerate(out) if r != flipped)


def test_a_flip_while_a_tolerated_drift_persists_evicts_the_flipped_rank(tmp_path: Path) -> None:
    evict = tmp_path / "evict.json"
    out = run_ranks(_persisting_then_flip, 3, 2, 0, "raise", str(evict), may_die=range(3))
    assert all(isinstance(o, RankDied) and o.exitcode == 17 for o in out), out
    doc = read_evict(evict)
    assert doc is not None and [h["rank"] for h in doc["hosts"]] == [0], doc
    assert "attribution's blame (at_rest_change)" in doc["hosts"][0]["why"], doc  # not the stale drift's


def test_under_warn_an_unrepaired_flip_persists_and_a_second_flip_on_another_rank_is_blamed_on_it() -> None:
    out = run_ranks(_persisting_then_flip, 3, 2, 0, "warn", None, None, None)
    divergent = _divergent(out[0]["records"])
    assert divergent[0]["blame"]["ranks"] == [2] and divergent[0]["blame"]["evidence"] == "at_rest_change"
    second = next(r for r in divergent if any(m["name"].endswith("0.weight") for m in r["mismatches"]))
    assert second["blame"]["ranks"] == [0] and second["blame"]["step"] == FLIP_AFTER + 1, second["blame"]


def test_a_persisting_blame_is_kept_while_it_explains_the_mismatches() -> None:
    out = run_ranks(_persisting_then_flip, 2, 1, None, "warn", None)
    divergent = _divergent(out[0]["records"])
    assert len(divergent) == STEPS - DRIFT_AFTER
    assert all(r["blame"]["ranks"] == [1] and r["blame"]["step"] == DRIFT_AFTER + 1 for r in divergent)


# -- issue 49 item 5: sentences true at the moment they are said ------------------------------------------


def _raising(rank: int, world: int) -> dict[str, Any]:
    import contextlib
    import io

    from weightsync_audit import WeightDivergenceError

    _, ddp, opt = build(rank)
    audit = LoopAudit(ddp, opt, every_n_steps=1, on_mismatch="raise", verbose=False, attribution=True)
    said, err = io.StringIO(), ""
    with contextlib.redirect_stderr(said):
        try:
            for step in range(1, STEPS + 1):
                train_step(ddp, opt, rank, step, None)
                audit.step(step)
                if step == FLIP_AFTER and rank == 0:
                    flip_bit(next(iter(ddp.parameters())), 5, 27)
        except WeightDivergenceError as exc:
            err = str(exc)
    return {"error": err, "stderr": said.getvalue()}


def test_the_exception_every_rank_raises_names_ranks_and_tensors_and_each_rank_says_it_first() -> None:
    out = run_ranks(_raising, 3)
    first = out[0]["error"].splitlines()[0]
    assert first.startswith(f"weights diverged across ranks at step {FLIP_AFTER + 1}: 1 tensor(s) differ (0.weight)")
    assert "on rank 0 against ranks [1, 2]" in first and "blamed: rank 0 (at_rest_change)" in first, first
    assert all(o["error"].splitlines()[0] == first for o in out)
    for rank in (1, 2):  # the main rank prints its table; every other rank one line, before it raises
        assert f"weightsync audit [rank {rank}]: {first}" in out[rank]["stderr"], out[rank]["stderr"]


def _right_after_a_load(rank: int, world: int) -> dict[str, Any]:
    from weightsync_audit import Auditor
    from weightsync_audit.engine.config import AuditConfig

    model, ddp, opt = build(rank)
    if rank == 1:
        _drift(model[0].weight)  # a rank that loaded other bytes: no step taken yet
    r = Auditor(ddp, opt, config=AuditConfig(pinpoint=True)).audit(step=0)
    return r.to_dict()


def test_no_pinpoint_note_and_no_none_before_any_step_was_taken() -> None:
    out = run_ranks(_right_after_a_load, 2)
    assert not out[0]["in_sync"]
    said = " ".join([*out[0].get("notes", []), *out[0].get("hints", []), str(out[0].get("pinpoint"))])
    assert "record_step" not in said and "pinpoint:" not in said, said
    assert "None" not in said


# -- issue 49 items 2 and 4: the checkpoint is evidence, one mismatch per tensor --------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _save_then_load(rank: int, world: int, folder: str, off: tuple[int, ...]) -> dict[str, Any]:
    path = os.path.join(folder, "step5.pt")
    model = _model()
    audit = LoopAudit(model, None, on_mismatch="resync", verbose=False)
    if rank == 0:
        torch.save(model.state_dict(), path)
    audit.checkpoint_saved(path, 5)
    with torch.no_grad():  # a rank that resumed from something else
        for p in model.parameters():
            p.mul_(1.5 + rank) if rank in off else None
    r = audit.checkpoint_loaded(path, 5)
    audit.close()
    saved = torch.load(path, weights_only=True)
    return {"record": r.to_dict() if r else None, "holds": all(torch.equal(saved[k], v) for k, v in
                                                                model.state_dict().items())}  # fmt: skip


def test_at_a_resume_the_ranks_off_the_checkpoint_are_blamed_and_repaired_from_one_that_holds_it(
    tmp_path: Path,
) -> None:
    out = run_ranks(_save_then_load, 2, str(tmp_path), (1,))
    r = out[0]["record"]
    assert r["blame"]["ranks"] == [1] and r["blame"]["evidence"] == "checkpoint", r["blame"]
    names = [m["name"] for m in r["mismatches"]]
    assert len(names) == len(set(names)) == 4, names  # one mismatch per tensor, counted once
    assert all(m["ranks"] == [1] and m["reference_ranks"] == [0] for m in r["mismatches"])  # table = blame
    assert r["hints"][0].startswith("the checkpoint load: rank 1 does not hold 0.bias, 0.weight"), r["hints"][0]
    assert r["action"] == "resynced" and out[0]["holds"] and out[1]["holds"]  # copied from the saved bytes


def test_where_no_rank_holds_the_saved_bytes_the_blame_says_so(tmp_path: Path) -> None:
    out = run_ranks(_save_then_load, 2, str(tmp_path), (0, 1))
    r = out[0]["record"]
    assert r["blame"]["ranks"] == [] and "as saved in step5.pt at step 5 (its sidecar)" in r["blame"]["detail"]
