"""Attribution under common training patterns, on 2 real gloo ranks (DDP): a closure optimizer (LBFGS),
gradient accumulation with ``no_sync`` (the same step marked twice), a ``GradScaler`` with fused, foreach
and single-tensor Adam (scaled gradients, skipped steps), and a software write at rest told from a bit
flip. Each test plants its fault itself and checks the blame against where it planted it."""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch
from attribution_faults import FaultyAdam, build, flip_bit
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from weightsync_audit import AttributionConfig, Auditor, LoopAudit
from weightsync_audit.engine.attribution.records import StepRecord
from weightsync_audit.engine.attribution.settle import attach_watch
from weightsync_audit.engine.config import AuditConfig


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _divergent(records: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    return [r for r in records if r is not None and not r["in_sync"]]


# -- LBFGS: a closure optimizer ----------------------------------------------------------------------


def _lbfgs(rank: int, world: int, faulty: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = DDP(model)
    opt = torch.optim.LBFGS(ddp.parameters(), lr=0.1, max_iter=2, history_size=4)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        audit = LoopAudit(ddp, opt, every_n_steps=1, verbose=False, attribution=True)
        records = []
        for step in range(1, 7):
            x, y = _batch(step, 0)  # the same batch everywhere: LBFGS keeps the (local) loss in its state

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                return loss

            opt.step(closure)
            r = audit.step(step)
            records.append(None if r is None else r.to_dict())
            if rank == faulty and step == 3:
                flip_bit(model[0].weight, 5, 27)  # at rest, before step 4
        audit.close()
    return {"records": records, "warnings": [str(w.message) for w in said]}


@pytest.mark.parametrize("faulty", [0, 1])
def test_lbfgs_a_flip_at_rest_is_blamed_and_the_replay_it_cannot_do_is_said(faulty: int) -> None:
    out = run_ranks(_lbfgs, 2, faulty)
    bad = _divergent(out[0]["records"])
    assert bad, "the flip was not seen"
    blame = bad[0]["blame"]
    assert blame["ranks"] == [faulty] and blame["evidence"] == "at_rest_change", blame
    assert blame["hardware_suspect"] is True and blame["step"] == 4, blame
    assert [b["blame"] for b in _divergent(out[1]["records"])][:1] == [blame]
    # The replay cannot re-run LBFGS's closure: it is declined, and the user is told so, once, on every rank.
    for rank in (0, 1):
        told = [w for w in out[rank]["warnings"] if "LBFGS" in w and "replay" in w]
        assert len(told) == 1, out[rank]["warnings"]
    assert not any("failed" in w for w in out[0]["warnings"]), out[0]["warnings"]


# -- gradient accumulation with no_sync: each step marked twice ------------------------------------


def _accumulating(rank: int, world: int, faulty: int) -> list[dict[str, Any] | None]:
    """Two micro-batches per optimizer step (the first under ``no_sync``), ``audit.step(global_step)`` after each,
    as Lightning's ``on_train_batch_end`` does; a bit flipped at rest on ``faulty`` between steps 2 and 3."""
    model, ddp, opt = build(rank)
    audit = LoopAudit(ddp, opt, every_n_steps=4, verbose=False, attribution=True)
    records: list[dict[str, Any] | None] = []
    global_step = 0
    for micro in range(1, 13):
        x, y = _batch(micro, rank)
        stepping = micro % 2 == 0
        with contextlib.nullcontext() if stepping else ddp.no_sync():
            (nn.functional.mse_loss(ddp(x), y) / 2).backward()
        if stepping:
            opt.step()
            opt.zero_grad()
            global_step += 1
        r = audit.step(global_step)
        records.append(None if r is None else r.to_dict())
        if rank == faulty and stepping and global_step == 2:
            flip_bit(model[0].weight, 5, 27)
    audit.close()
    return records


@pytest.mark.parametrize("faulty", [0, 1])
def test_no_sync_accumulation_marks_each_step_once_and_names_the_flipped_rank(faulty: int) -> None:
    out = run_ranks(_accumulating, 2, faulty)
    bad = _divergent(out[0])
    assert bad, "the flip was not seen"
    blame = bad[0]["blame"]
    assert (blame["ranks"], blame["evidence"], blame["step"]) == ([faulty], "at_rest_change", 3), blame
    assert _divergent(out[1])[0]["blame"] == blame


# -- GradScaler with fused / foreach / single-tensor Adam -----------------------------------------


IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}


def _scaled(rank: int, world: int, impl: str, faulty: int | None, audit_every: int) -> dict[str, Any]:
    """Adam (``impl``) under a ``GradScaler``; step 3's loss is inf on every rank (the scaler skips that step);
    at the 5th optimizer step ``faulty``'s update is off by one ulp in one element."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = DDP(model)
    opt = FaultyAdam(ddp.parameters(), lr=1e-2, **IMPLEMENTATIONS[impl])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    auditor = Auditor(ddp, opt, config=AuditConfig(attribution=AttributionConfig(recheck=1)))
    auditor.attribution = watch = attach_watch(auditor, ddp, [opt])
    out, records, params = [], [], []
    for step in range(1, 9):
        x, y = _batch(step, rank)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y) * (math.inf if step == 3 else 1.0)
        scaler.scale(loss).backward()
        opt.fault_at = opt.taken + 1 if rank == faulty and step == 6 else None
        scaler.step(opt)
        scaler.update()
        watch.mark(step)
        records.append({k: v for k, v in watch.records[-1].as_dict().items() if k != "hyper_text"})
        params.append([p.detach().clone() for p in model.parameters()])
        if step % audit_every == 0:
            out.append(auditor.audit(step=step).to_dict())
    return {"audits": out, "records": records, "params": params}


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_gradscaler_healthy_steps_replay_exactly_and_a_skipped_step_is_a_step_skipped(impl: str) -> None:
    out = run_ranks(_scaled, 2, impl, None, 100)
    for rank in (0, 1):
        recs = out[rank]["records"]
        assert not [r for r in recs if r.get("update")], recs  # every healthy update reproduced by its replay
        assert all(r.get("covered") for r in recs if r["stepped"]), recs
        # The skipped step (inf): the fused step is called and changes nothing; the others are not called.
        assert torch.equal(torch.cat([p.view(-1) for p in out[rank]["params"][2]]),
                           torch.cat([p.view(-1) for p in out[rank]["params"][1]]))  # fmt: skip


@pytest.mark.parametrize("impl", ["fused", "single"])
def test_gradscaler_a_one_ulp_compute_fault_is_the_compute_on_that_rank(impl: str) -> None:
    out = run_ranks(_scaled, 2, impl, 1, 2)
    # The truth, from the bytes: the replicas part at step 6, on rank 1's weight (the fault's).
    truth = [
        s for s in range(8) if not all(torch.equal(a, b) for a, b in zip(out[0]["params"][s], out[1]["params"][s]))
    ]
    assert truth and truth[0] == 5
    bad = [a for a in out[0]["audits"] if not a["in_sync"]]
    blame = bad[0]["blame"]
    assert (blame["ranks"], blame["evidence"], blame["step"]) == ([1], "update_not_reproducible", 6), blame
    assert blame["hardware_suspect"] is True


# -- a software write at rest, told from a bit flip -------------------------------------------------


def _written(rank: int, world: int, how: str, faulty: int) -> dict[str, Any]:
    model, ddp, opt = build(rank)
    audit = LoopAudit(ddp, opt, every_n_steps=2, verbose=False, attribution=True)
    records = []
    for step in range(1, 7):
        x, y = _batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        r = audit.step(step)
        records.append(None if r is None else r.to_dict())
        if rank == faulty and step == 2:
            w = model[0].weight
            with torch.no_grad():
                if how == "copy_":
                    w.copy_(torch.randn_like(w))  # a whole tensor rewritten (a load on one rank, a re-init)
                elif how == ".data":
                    w.data.copy_(torch.randn_like(w))  # the same, where no version counter sees it
                elif how == ".data one element":
                    w.data[1, 2] = 0.25
                else:
                    flip_bit(w, 5, 27)
    audit.close()
    return {"records": records, "numel": model[0].weight.numel()}


@pytest.mark.parametrize(
    ("how", "faulty", "evidence", "hardware"),
    [
        ("copy_", 1, "at_rest_write", False),
        (".data", 0, "at_rest_write", False),
        (".data one element", 1, "at_rest_write", False),
        ("flip", 1, "at_rest_change", True),
    ],
)
def test_a_write_at_rest_is_software_and_a_bit_flip_is_the_memory(
    how: str, faulty: int, evidence: str, hardware: bool
) -> None:
    out = run_ranks(_written, 2, how, faulty)
    bad = _divergent(out[0]["records"])
    blame = bad[0]["blame"]
    assert (blame["ranks"], blame["evidence"], blame["hardware_suspect"]) == ([faulty], evidence, hardware), blame
    hint = bad[0]["hints"][0]
    assert ("memory test" in hint) is hardware, hint
    if how == "copy_":
        assert f"{out[0]['numel']} of {out[0]['numel']} elements" in blame["detail"], blame
    if how == "flip":
        assert "1 bit in 1 of" in blame["detail"], blame


# -- with overlap=True: the at-rest reads off the training thread ---------------------------------------


def _offloaded(rank: int, world: int, how: str, faulty: int, report: str) -> int:
    """``overlap=True``: the at-rest reads and the collective check's digests run on workers. Each step's forward
    and backward take about 30 ms (a sleep stands for them); after step 3's launch ``faulty``'s weight gets a bit
    flipped at once (between the reads), or is written through torch right before step 4 (after the late read:
    its counter tells), or at step 4 its gradient is halved after the all-reduce, or at step 4 its weight gets a
    bit flipped right before the optimizer step (after the late read: the replay's pre-step copy tells)."""
    import time

    model, ddp, opt = build(rank)
    audit = LoopAudit(ddp, opt, every_n_steps=1, verbose=False, attribution=True, overlap=True, report_path=report)
    for step in range(1, 7):
        x, y = _batch(step, rank)
        time.sleep(0.03)
        if rank == faulty and step == 4 and how == "write late":
            with torch.no_grad():
                model[0].weight[0, 0] += 1.0
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        if rank == faulty and step == 4 and how == "grad after reduce":
            with torch.no_grad():
                model[2].weight.grad.mul_(0.5)  # local code between the all-reduce and the step
        if rank == faulty and step == 4 and how == "flip late":
            flip_bit(model[0].weight, 5, 27)  # right before the step: after every late read began
        opt.step()
        audit.step(step)
        if rank == faulty and step == 3 and how == "flip":
            flip_bit(model[0].weight, 5, 27)
    reads = audit.runner.auditor.attribution.rest.reader.late_reads
    audit.close()
    return reads


@pytest.mark.parametrize(
    ("how", "faulty", "evidence"),
    [
        ("flip", 1, "at_rest_change"),
        ("write late", 0, "at_rest_write"),
        ("grad after reduce", 1, "deterministic_difference"),
        ("flip late", 0, "at_rest_change"),  # seen through the replay's pre-step copy, not the late read
    ],
)
def test_with_overlap_the_at_rest_check_runs_off_the_training_thread_and_still_names_the_rank(
    tmp_path: Any, how: str, faulty: int, evidence: str
) -> None:
    import json

    report = tmp_path / "r.jsonl"
    reads = run_ranks(_offloaded, 2, how, faulty, str(report))
    assert min(reads) >= 1 and sum(reads) >= 4, reads  # the late reads ran, on the worker
    records = [json.loads(line) for line in report.read_text().splitlines()]
    bad = [r for r in records if not r["in_sync"]]
    assert bad and bad[0]["step"] == 4, [(r["step"], r["in_sync"]) for r in records]
    blame = bad[0]["blame"]
    assert (blame["ranks"], blame["evidence"], blame["step"]) == ([faulty], evidence, 4), blame
    assert blame["hardware_suspect"] is (evidence == "at_rest_change")


def test_an_at_rest_rebase_that_fails_after_a_repair_is_recorded_and_warned_never_raised() -> None:
    """After a confirmed repair the watch re-reads its at-rest baseline; a failure there is the watch's to
    report (the step's record and one warning), never an exception out of the user's training."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    watch = attach_watch(Auditor(model, opt, config=AuditConfig(attribution=AttributionConfig(at_rest=True))),
                         model, [opt])  # fmt: skip
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    watch.mark(1)
    assert watch.last_post is not None

    def broken() -> None:
        raise RuntimeError("no baseline")

    watch.rest.rebase = broken  # type: ignore[method-assign]
    with pytest.warns(Warning, match="at-rest check after a repair failed"):
        watch.repaired()
    assert watch.current is not None and watch.current.failed.startswith("at-rest check after a repair: ")
    assert watch.last_post is None
    watch.detach()


def _post_words(offload: bool, emptied_at: int | None) -> dict[int, int | None]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    watch = attach_watch(Auditor(model, opt, config=AuditConfig(attribution=AttributionConfig(at_rest=True))),
                         model, [opt], offload=offload)  # fmt: skip
    for step in (1, 2, 3):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        watch.mark(step)
        if step == emptied_at:
            watch.in_sync()
    words = {r["step"]: r.get("post") for r in watch.payload()["records"]}
    assert all(isinstance(r, StepRecord) and r.post == words[r.step] for r in watch.records)
    watch.detach()
    return words


def test_an_offloaded_post_step_word_reaches_its_own_frozen_record_or_none_never_the_next() -> None:
    """Offloaded, a step's post-step word is settled after its mark (at the next pre-step hook, or the payload):
    the step's frozen record is replaced with one holding it while the ring holds it; once an in-sync audit
    emptied the ring, it goes nowhere (never into the next step's)."""
    sync = _post_words(False, None)
    assert sorted(sync) == [1, 2, 3] and None not in sync.values() and len(set(sync.values())) == 3
    assert _post_words(True, None) == sync
    assert _post_words(True, 1) == {2: sync[2], 3: sync[3]}


def _late_post_read(
    model: nn.Module, between: Callable[[], None], recheck: int = 0, fused: bool = False
) -> dict[int, StepRecord]:
    """Three SGD steps (``fused``: fused Adam's) under an offloaded watch (``recheck``: with the update replay); at
    step 2 the post-step read waits behind a gate (queued from a pre-step hook, after the watch's own) while
    ``between`` runs right after the update. The records by step."""
    import threading

    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    config = AuditConfig(attribution=AttributionConfig(at_rest=True, recheck=recheck))
    watch = attach_watch(Auditor(model, opt, config=config), model, [opt], offload=True)
    gate = threading.Event()
    for step in (1, 2, 3):
        if step == 2:
            hold = opt.register_step_pre_hook(lambda *_: [watch.rest.reader._worker.submit(gate.wait)][:0] or None)
        model(torch.ones(2, 256)).sum().backward()
        opt.step()
        watch.mark(step)
        if step == 2:
            hold.remove()
            between()
            gate.set()
    records = {r.step: r for r in watch.records}
    watch.detach()
    return records


def test_a_write_that_lands_before_the_offloaded_post_step_read_is_still_a_change_at_rest() -> None:
    """Offloaded, the post-step read runs on a worker: a write through torch right after the step (a clamp)
    can land before that read, which then holds the written bytes. The write is still in the next step's
    record (its counter moved past the post-step stamp), so a rank whose read came late never looks clean
    beside one whose read came first: in the campaign's clamp run that gave the other rank's bit flip a
    false ``at_rest_write`` blame instead of an undecided one."""
    torch.manual_seed(0)
    model = nn.Linear(256, 128)  # a weight over 64 KiB: read by the worker, not hashed in the post-step hook

    def clamp() -> None:
        with torch.no_grad():
            model.weight.clamp_(-0.01, 0.01)  # the clamp, before the read

    records = _late_post_read(model, clamp)
    assert records[3].rest == ("weight",), records[3]
    assert [e.moved for e in records[3].rest_evidence] == [True]
    assert records[2].post is None  # its read raced the write: the step's post-step word is unknown


def test_a_flip_on_a_frozen_tensor_before_the_offloaded_post_step_read_is_a_change_at_rest_of_that_step() -> None:
    """Offloaded, the post-step read can come after a flip that landed right after the update. On a tensor the
    step wrote, the replay's copies catch that; a frozen one (no gradient, no counter moved across the step)
    has none. Its read then differs from its bytes before the step: that is a change at rest in the step's
    record (the step's ``pre`` word with it), never "from the same inputs the steps gave other bytes" (seed
    8 ``r31``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 4))  # the frozen weight over 64 KiB: the worker's
    model[0].requires_grad_(False)

    def flip() -> None:  # behind torch's back: no counter moves
        model[0].weight.detach().numpy().view(np.int32)[5, 7] ^= 1 << 3

    records = _late_post_read(model, flip)
    assert records[2].rest == ("0.weight",) and [e.moved for e in records[2].rest_evidence] == [False]
    assert records[2].pre is not None and records[3].rest == ()


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_a_flip_on_a_replayed_tensor_before_the_offloaded_post_step_read_is_a_change_at_rest_after_the_step(
    fused: bool,
) -> None:
    """Offloaded, the post-step read can come after a flip that landed right after the update, on a tensor the
    step wrote. The replay saw that tensor's bytes right after the update (its own result reproduced): those are
    the step's post-step bytes, so the flip is a change at rest before the next step, in that step's record, and
    the step's own post-step word is the bytes it wrote. Read as the step's result instead, every rank's replay
    reproduced its own while the ranks' post-step words differed from the same pre-step words: "a deterministic
    difference in the step itself", no rank named (campaign seed 9 ``r02-fault01``, fused Adam)."""
    torch.manual_seed(0)
    model = nn.Linear(256, 128)  # a weight over 64 KiB: read by the worker, not hashed in the post-step hook

    def flip() -> None:  # behind torch's back: no counter moves
        model.weight.detach().numpy().view(np.int32)[5, 7] ^= 1 << 3

    records = _late_post_read(model, flip, recheck=1, fused=fused)
    assert records[2].update == () and records[2].post is not None, records[2]
    assert records[3].rest == ("weight",) and [e.moved for e in records[3].rest_evidence] == [False], records[3]
    assert records[3].pre is not None and records[3].pre != records[2].post


def test_an_update_that_moves_no_counter_is_never_a_change_at_rest_with_overlap() -> None:
    """A fused optimizer writes its parameters without moving their version counters: only a parameter left
    without a gradient is taken as one the step did not write (campaign seed 8, fused Adam, every rank's
    update read as changed at rest before that rule)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    watch = attach_watch(Auditor(model, opt, config=AuditConfig(attribution=AttributionConfig(at_rest=True))),
                         model, [opt], offload=True)  # fmt: skip
    for step in (1, 2, 3, 4):
        opt.zero_grad()
        model(torch.ones(2, 256)).sum().backward()
        opt.step()
        watch.mark(step)
    records = watch.payload()["records"]
    watch.detach()
    assert len(records) == 4 and [r.get("rest", []) for r in records] == [[]] * 4, records


def _planted_before_a_step(
    rank: int, world: int, report: str, fault: str, faulty: int, at_step: int, overlap: bool
) -> list[dict[str, Any]]:
    """``LoopAudit`` with attribution and ``include`` grads, an audit every 2 steps; at ``at_step`` on rank
    ``faulty``, ``fault`` is planted right before the step: ``"grad"`` one gradient element changed after the
    all-reduce (a global hook, registered before the gradient audit's), ``"lr"`` the learning rate raised in
    the optimizer's own pre-step hook (set back after the step). The report's divergent records (rank 0's)."""
    import json

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    at = {"step": 0}

    def grad(o: Any, *_: Any) -> None:
        if fault == "grad" and rank == faulty and at["step"] == at_step:
            g = model[2].weight.grad
            g.view(-1)[3] = g.view(-1)[3] * (1 + 2**-10) + 2**-20

    def lr(o: Any, *_: Any) -> None:
        if fault == "lr" and rank == faulty and at["step"] == at_step:
            o.param_groups[0]["lr"] = 1e-1

    def lr_back(o: Any, *_: Any) -> None:
        o.param_groups[0]["lr"] = 1e-2

    handle = register_optimizer_step_pre_hook(grad)
    audit = LoopAudit(ddp, opt, every_n_steps=2, verbose=False, attribution=True, report_path=report, overlap=overlap,
                      include=("params", "buffers", "optimizer", "grads"))  # fmt: skip
    opt.register_step_pre_hook(lr)  # before the watch's own hooks, set at the first step
    opt.register_step_post_hook(lr_back)
    for step in range(1, 9):
        at["step"] = step
        x, y = _batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        audit.step(step)
    audit.close()
    handle.remove()
    if rank != 0:  # rank 0 writes the report
        return []
    with open(report) as f:
        return _divergent([json.loads(line) for line in f])


@pytest.mark.parametrize(("faulty", "at_step", "overlap"), [(0, 5, False), (1, 5, True), (1, 6, False), (0, 6, True)])
def test_the_gradient_audit_before_a_step_is_blamed_from_the_records_and_leaves_them_to_the_next_audit(
    tmp_path: Any, faulty: int, at_step: int, overlap: bool
) -> None:
    """With ``include`` grads the first audit to see a divergence is often the gradient audit before a step:
    it blames from attribution's records as the run's own audits do (it once took the vote alone: a tie,
    undecided), and leaves them to the audit after the step, which blames the same. At an audited step
    (6) the gradient audit reads the record of the step under way, its gradients read first."""
    bad = run_ranks(_planted_before_a_step, 2, str(tmp_path / "r.jsonl"), "grad", faulty, at_step, overlap)[0]
    assert [(r["step"], r["hook"]) for r in bad[:2]] == [(6, "before_optimizer_step"), (6, "step")]
    for r in bad:
        blame = r["blame"]
        assert (blame["ranks"], blame["evidence"], blame["step"]) == ([faulty], "deterministic_difference", at_step), r
        assert "gradient of 2.weight changed after the all-reduce" in blame["detail"]


def test_the_gradient_audit_leaves_the_step_to_its_hooks_which_still_see_a_learning_rate_set_inside_them(
    tmp_path: Any,
) -> None:
    """The gradient audit before a step reads the step under way without opening its record: the step's own
    pre-step hooks open it, after every hook set before them, and see a learning rate one of those set on one
    rank (opened by the audit, the record read the learning rate before that hook, and the blame was undecided)."""
    bad = run_ranks(_planted_before_a_step, 2, str(tmp_path / "r.jsonl"), "lr", 1, 4, False)[0]
    blame = bad[0]["blame"]
    assert (bad[0]["step"], bad[0]["hook"]) == (4, "step"), bad[0]
    assert (blame["ranks"], blame["evidence"], blame["step"]) == ([1], "deterministic_difference", 4), blame
    assert "lr" in blame["detail"], blame


def _flipped_before_the_second_step(rank: int, world: int, overlap: bool) -> list[dict[str, Any]]:
    """Rank 0's weight flipped at rest before step 2's update: the first step after the adapter set the watch
    (at its first call after step 1), the step whose at-rest check once had nothing to compare with."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = 0

    def plant(o: Any, *_: Any) -> None:  # after the backward, before the library's hooks and the update
        if o is opt and step == 2 and rank == 0:
            flip_bit(net[0].weight.detach(), 5, 25)

    records: list[dict[str, Any]] = []

    class Keep:
        def write(self, record: Any) -> None:
            records.append(record.to_dict())

    hook = register_optimizer_step_pre_hook(plant)
    audit = LoopAudit(model, opt, every_n_steps=1, attribution=True, overlap=overlap, verbose=False, sinks=[Keep()])
    for step in range(1, 4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        audit.step(step)
    audit.close()
    hook.remove()
    return records


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_flip_at_rest_before_the_second_step_is_blamed_on_its_rank(overlap: bool) -> None:
    # Before: the watch, set at the first call after step 1, had no bytes after step 1 to compare step 2's
    # with: "the ranks already differed before step 2: earlier than the records", a tie, undecided.
    out = run_ranks(_flipped_before_the_second_step, 2, overlap)[0]
    first = next(r for r in out if not r["in_sync"])
    assert first["step"] == 2, first
    assert first["blame"]["ranks"] == [0] and first["blame"]["evidence"] == "at_rest_change", first["blame"]


def _flipped_before_the_first_step(rank: int, world: int) -> dict[str, Any]:
    """An ``Auditor`` with ``attach_watch`` set before training; rank 0's weight flipped before step 1's update."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    auditor = Auditor(model, opt, config=AuditConfig(attribution=AttributionConfig()))
    auditor.attribution = attach_watch(auditor, model, [opt])
    model(torch.ones(4, 8)).square().mean().backward()
    if rank == 0:
        flip_bit(net[0].weight.detach(), 5, 25)  # after attaching, before the first update
    opt.step()
    auditor.attribution.mark(1)
    return auditor.audit(step=1).to_dict()


def test_a_flip_after_attach_watch_and_before_the_first_step_is_blamed_on_its_rank() -> None:
    # The watch reads the bytes at rest when it is set (attach_watch, for an adapter or a user alike): before,
    # the first step's at-rest check had nothing to compare with ("earlier than the records", a tie).
    record = run_ranks(_flipped_before_the_first_step, 2)[0]
    assert not record["in_sync"] and record["blame"]["ranks"] == [0], record["blame"]
    assert record["blame"]["evidence"] == "at_rest_change", record["blame"]
