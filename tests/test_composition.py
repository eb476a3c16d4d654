"""Features that compose (issue 41 items 1, 2, 3, 8; issue 42 item 5; issue 44 item 2's machine wording), on
real gloo ranks, each truth computed from the bytes gathered per rank:

- two faults in sequence (rank 0, then rank 1 at the very next audit) under attribution and resync: each
  repair copies the healthy rank's bytes, never the corrupted rank's, synchronous or overlapped, and both
  schedules take the same decisions;
- overlapped records carry attribution's blame, and a later synchronous audit never blames an old, repaired
  event;
- the duplicate-batch check gives the same notes with and without overlap;
- a tie names no machine for eviction; a strict majority or attribution's blame does;
- a cause back after every resync is called the machine's, to evict, only on evidence about the machine.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from attribution_faults import Fault, build, flip_bit, train_step
from ranks import RankDied, run_ranks

from weightsync_audit import AuditOptions, LoopAudit
from weightsync_audit.engine.timeline.step_records import describe
from weightsync_audit.integrations.evict import EVICT_FILE_ENV, SEGMENT_DIR_ENV


def _gathered(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, [t.detach().clone() for t in tensors])
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _run(
    rank: int,
    world: int,
    *,
    overlap: bool,
    flips: tuple[tuple[int, int], ...] = (),
    lr_from: int | None = None,
    lr_once: int | None = None,
    steps: int = 6,
    nudge_at_end: bool = False,
) -> dict[str, Any]:
    """DDP + Adam under ``LoopAudit(attribution=True, on_mismatch="resync")``, audited after every step.

    ``flips``: (rank, step) whose parameter 0 gets a bit flipped at rest right after that step's audit (seen
    at the next one). ``lr_from``: from that step on rank 1 sets its own lr before every step (a software bug
    that comes back after each resync); ``lr_once``: rank 1's lr x10 at that step only. ``nudge_at_end``: rank
    1's parameter 0 changed at rest after the last step, then a synchronous ``audit()``. Rank 0 returns every
    rank's bytes before and after each audit."""
    _, ddp, opt = build(rank)
    audit = LoopAudit(ddp, opt, every_n_steps=1, on_mismatch="resync", verbose=False, attribution=True,
                      overlap=overlap)  # fmt: skip
    params = list(ddp.parameters())
    out: list[dict[str, Any]] = []
    for step in range(1, steps + 1):
        if lr_from is not None and rank == 1 and step >= lr_from:
            for group in opt.param_groups:
                group["lr"] = 0.1  # this rank's own learning rate, set before every step
        fault = Fault("lr_one_rank", 1, lr_once) if lr_once is not None else None
        if overlap:  # a forward and backward of some length (a sleep stands for them): the window in which the
            time.sleep(0.03)  # offloaded at-rest reads run, and in which a flip lands between them (offload.py)
        train_step(ddp, opt, rank, step, fault)
        before = _gathered(params)
        result = audit.step(step)
        if overlap:
            assert result is None  # launched; the verdict is acted on at the safe point, here
            result = audit.settle()
        after = _gathered(params)
        assert result is not None
        out.append({"step": step, "record": result.to_dict(), "before": before, "after": after})
        if (rank, step) in flips:
            flip_bit(params[0], 5, 27)
    if nudge_at_end:
        if rank == 1:
            with torch.no_grad():
                params[0][0, 0] += 1e-3
        before = _gathered(params)
        final = audit.audit(steps + 1)
        assert final is not None
        out.append({"step": steps + 1, "record": final.to_dict(), "before": before, "after": _gathered(params)})
    audit.close()
    if rank != 0:
        for o in out:
            o.pop("before"), o.pop("after")
    return {"audits": out}


def _decisions(audits: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What each audit decided: its verdict, action, blame and the resync's source note."""
    out = []
    for a in audits:
        r = a["record"]
        blame = r.get("blame") or {}
        source = [n for n in r.get("notes", []) if n.startswith("tie vote on") or n.startswith("resynced ")]
        out.append((r["step"], r["in_sync"], r["action"], blame.get("ranks"), blame.get("evidence"), source))
    return out


@functools.cache
def _two_faults(overlap: bool) -> list[dict[str, Any]]:
    return run_ranks(_run, 2, overlap=overlap, flips=((0, 3), (1, 4)), steps=6, timeout=120)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_two_faults_in_sequence_are_each_repaired_from_the_healthy_rank(overlap: bool) -> None:
    out = _two_faults(overlap)
    audits = out[0]["audits"]
    assert _decisions(audits) == _decisions(out[1]["audits"])  # every rank decided the same
    for a in audits:
        before, after = a["before"], a["after"]
        # the truth from the bytes: which ranks hold other bytes than rank 0 before the audit
        parted = not _same(before[0], before[1])
        assert (not a["record"]["in_sync"]) == parted, a["step"]
        if not parted:
            assert a["record"]["action"] == "none" and _same(after[0], before[0]), a["step"]
            continue
        faulty = {4: 0, 5: 1}[a["step"]]  # flipped right after the audit before
        healthy = 1 - faulty
        # only the flipped tensor differs, and the repair copied the healthy rank's bytes over the corrupted one
        assert [torch.equal(x, y) for x, y in zip(before[0], before[1])] == [False, True, True, True]
        assert all(_same(after[r], before[healthy]) for r in (0, 1)), f"repaired from rank {faulty} at {a['step']}"
        assert not _same(after[faulty], before[faulty])
        assert a["record"]["action"] == "resynced"
    assert [a["step"] for a in audits if not a["record"]["in_sync"]] == [4, 5]
    for step, faulty in ((4, 0), (5, 1)):  # what each record says: the blame of the divergence in front of it
        r = audits[step - 1]["record"]
        assert r["action"] == "resynced" and r["blame"]["ranks"] == [faulty], r
        assert (r["blame"]["evidence"], r["blame"]["step"]) == ("at_rest_change", step), r["blame"]
        [source] = [n for n in r["notes"] if n.startswith("tie vote on 0.weight")]
        assert f"resynced from rank {1 - faulty} (" in source and f"rank {faulty} blamed by attribution" in source
        if overlap:
            assert r["overlap"]["covers_step"] == step and r["overlap"]["settled_at"] == "settle"


def test_an_overlapped_audit_decides_exactly_as_a_synchronous_one() -> None:
    assert _decisions(_two_faults(True)[0]["audits"]) == _decisions(_two_faults(False)[0]["audits"])


def test_overlapped_records_carry_the_blame_and_a_later_audit_never_blames_a_repaired_event() -> None:
    out = run_ranks(_run, 2, overlap=True, flips=((0, 3),), lr_once=6, steps=8, nudge_at_end=True, timeout=120)
    audits = {a["step"]: a for a in out[0]["audits"]}
    assert _decisions(out[0]["audits"]) == _decisions(out[1]["audits"])
    flip, lr, final = audits[4]["record"], audits[6]["record"], audits[9]["record"]
    assert flip["overlap"]["covers_step"] == 4 and lr["overlap"]["covers_step"] == 6 and "overlap" not in final
    # step 4: rank 0's bit flip at rest; step 6: rank 1's own learning rate (software, not the machine)
    assert (flip["blame"]["ranks"], flip["blame"]["evidence"], flip["blame"]["hardware_suspect"]) == (
        [0], "at_rest_change", True
    )  # fmt: skip
    assert (lr["blame"]["ranks"], lr["blame"]["evidence"], lr["blame"]["hardware_suspect"]) == (
        [1], "deterministic_difference", False
    )  # fmt: skip
    for step, healthy in ((4, 1), (6, 0)):
        a = audits[step]
        assert a["record"]["action"] == "resynced"
        assert all(_same(a["after"][r], a["before"][healthy]) for r in (0, 1))
    # the later synchronous audit: rank 1's parameter changed at rest, never rank 0's repaired flip of step 4
    before = audits[9]["before"]
    assert not torch.equal(before[0][0], before[1][0]) and all(
        torch.equal(x, y) for x, y in zip(before[0][1:], before[1][1:])
    )
    assert final["blame"]["ranks"] == [1] and final["blame"]["step"] != 4, final["blame"]
    assert all(_same(audits[9]["after"][r], before[0]) for r in (0, 1))


# -- issue 41 item 8: the duplicate-batch check with overlap -----------------------------------------------


def _batches(rank: int, world: int, overlap: bool, report: str) -> list[list[str]]:
    """Rank 1 draws rank 0's batch on even steps (one shard restored on every rank); no training."""
    model = torch.nn.Linear(4, 2)
    audit = LoopAudit(model, every_n_steps=1, check_batches=True, verbose=False, overlap=overlap, report_path=report)
    due = []
    for step in range(1, 9):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + (0 if step % 2 == 0 else rank)))
        everyone = _gathered([x])  # the truth: which ranks hold byte-identical batches
        groups = [[r for r in range(world) if torch.equal(everyone[r][0], everyone[0][0])]]
        due.append([describe(groups, step)] if len(groups[0]) > 1 else [])
        audit.step(step, batch=x)
    audit.close()
    return due


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_check_batches_gives_the_same_notes_with_and_without_overlap(tmp_path: Path, overlap: bool) -> None:
    report = tmp_path / "r.jsonl"
    due = run_ranks(_batches, 2, overlap, str(report))[0]
    records = [json.loads(line) for line in report.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert sum(map(len, due)) == 4
    assert [[n for n in r.get("notes", []) if "identical batches" in n] for r in records] == due
    assert all(("overlap" in r) is overlap for r in records)


# -- issue 42 item 5: a machine is named for eviction only on evidence -----------------------------------------


def _evicting(rank: int, world: int, folder: str, attribution: bool) -> None:
    """Rank 0's weight corrupted, then an audit with ``exit_code``: every rank exits 17 (os._exit)."""
    os.environ.update({EVICT_FILE_ENV: f"{folder}/evict.json", SEGMENT_DIR_ENV: f"{folder}/health",
                       "SLURM_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": str(rank)})  # fmt: skip
    from weightsync_audit.engine.attribution.settle import watch_run
    from weightsync_audit.integrations.session.runner import AuditRunner

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = AuditRunner(AuditOptions(on_mismatch="raise", exit_code=17, verbose=False, attribution=attribution))
    runner.open(world_size=world, is_main=rank == 0)
    watch_run(runner, model, [opt])
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # the same gradients everywhere: the replicas agree after it
    runner.record_step(model, [opt], 1)  # the step's record closed (local)
    if rank == 0:
        flip_bit(model.weight, 0, 30)  # corrupted at rest, as the memory does (no version counter moves)
    everyone = _gathered([model.weight])  # the truth: the ranks outside a strict majority of equal bytes
    same = [sum(torch.equal(everyone[r][0], everyone[q][0]) for q in range(world)) for r in range(world)]
    odd = [r for r in range(world) if 2 * max(same) > world and same[r] < max(same)]
    Path(folder, f"truth{rank}.json").write_text(json.dumps(odd))
    runner.run(model, [opt], step=1, epoch=0, hook="step", is_main=rank == 0)  # exits 17


@pytest.mark.parametrize(("world", "attribution", "named"), [(2, False, []), (3, False, [0]), (2, True, [0])],
                         ids=["tie", "majority", "tie+attribution"])  # fmt: skip
def test_a_machine_is_named_for_eviction_only_on_evidence(
    tmp_path: Path, world: int, attribution: bool, named: list[int]
) -> None:
    out = run_ranks(_evicting, world, str(tmp_path), attribution, may_die=range(world))
    assert all(isinstance(o, RankDied) and o.exitcode == 17 for o in out), out
    truth = json.loads((tmp_path / "truth0.json").read_text())
    assert truth == ([0] if world == 3 else [])  # no strict majority among 2 ranks
    doc = json.loads((tmp_path / "evict.json").read_text())
    assert [h["rank"] for h in doc["hosts"]] == named and doc["exit_code"] == 17
    health = sorted(p.name for p in (tmp_path / "health").glob("*")) if (tmp_path / "health").exists() else []
    assert health == [f"segment_health_check.77.{r}" for r in named]  # only a rank named writes NVRx's file
    if not named:
        assert doc["unnamed"].startswith("no machine could be named: tie vote on weight: no majority"), doc
        assert 1 not in [h["rank"] for h in doc["hosts"]]  # the healthy rank, never
    else:
        assert "unnamed" not in doc
        why = doc["hosts"][0]["why"]
        assert ("attribution's blame (at_rest_change)" if attribution else "a strict majority") in why, why


# -- issue 44 item 2: the "machine" wording only on evidence about the machine -------------------------------


def test_a_software_cause_back_after_every_resync_is_not_called_the_machine() -> None:
    out = run_ranks(_run, 2, overlap=False, lr_from=3, steps=5, timeout=120)
    audits = out[0]["audits"]
    diverged = [a for a in audits if not a["record"]["in_sync"]]
    assert [a["step"] for a in diverged] == [3, 4, 5]
    for a in diverged:  # repaired from rank 0, the rank with the intended lr, every time
        r = a["record"]
        assert r["action"] == "resynced" and r["blame"]["ranks"] == [1] and not r["blame"]["hardware_suspect"]
        assert all(_same(a["after"][q], a["before"][0]) for q in (0, 1))
    assert not any("diverged again" in h for h in diverged[0]["record"]["hints"])
    for a in diverged[1:]:
        [hint] = [h for h in a["record"].get("hints", []) if "diverged again" in h]
        assert hint.startswith(f"rank 1 diverged again after a resync repaired it at step {a['step'] - 1}")
        assert "the cause persists" in hint and "Nothing says it is the machine" in hint
        assert "persistent fault on that machine" not in hint and "evict it" not in hint


def test_a_machine_that_corrupts_again_after_a_resync_is_called_a_persistent_fault_to_evict() -> None:
    import socket

    out = run_ranks(_run, 2, overlap=False, flips=((1, 3), (1, 4)), steps=5, timeout=120)
    audits = {a["step"]: a["record"] for a in out[0]["audits"]}
    assert not any("diverged again" in h for h in audits[4].get("hints", []))
    [hint] = [h for h in audits[5].get("hints", []) if "diverged again" in h]
    assert hint.startswith("rank 1 diverged again after a resync repaired it at step 4: a persistent fault on that")
    assert socket.gethostname() in hint and "evict it" in hint
