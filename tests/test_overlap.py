"""The overlapped audit (``overlap=True``) on real gloo ranks under DDP: step s digested and compared while
step s+1's forward and backward (and DDP's all-reduce on the default group) run, settled before the next
optimizer step. It finds a planted divergence naming the step it covers, stays silent on a healthy run,
raises on every rank together at the next safe point, resyncs to bit-identical replicas, and names a write
made outside the optimizer inside the window instead of comparing a half-updated tensor."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from weightsync_audit import Auditor, AuditResult, LoopAudit, ReportFormatError, WeightDivergenceError


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _hold_the_worker(audit: LoopAudit) -> threading.Event:
    """Queue a wait on the overlap's worker thread: the next launch's digests start once the returned gate is set,
    so that a write made in the window lands before they read, every time (not only when the training thread
    happens to be quicker than the worker)."""
    gate = threading.Event()
    window = audit.runner.auditor.window
    assert window is not None and window._worker is not None, "the worker starts at the first launch"
    window._worker.submit(lambda: gate.wait(60))
    return gate


def _train(rank: int, world: int, report: str, on_mismatch: str, plant_at: int | None, pinpoint: bool = False) -> dict:
    """Adam under DDP, audited after every step with overlap; rank 1 drifts right after step ``plant_at``."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    audit = LoopAudit(
        model, opt, every_n_steps=1, on_mismatch=on_mismatch, report_path=report, overlap=True, pinpoint=pinpoint
    )
    audit.runner.verbose = False
    where, raised_step, raised_covers = "", None, None
    try:
        for step in range(1, 7):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + rank))
            opt.zero_grad()
            model(x).square().mean().backward()  # the next step's all-reduce runs while the audit exchanges
            where = f"opt.step() of step {step}"
            opt.step()
            where = f"after step {step}"
            if rank == 1 and step == plant_at:
                with torch.no_grad():
                    net[0].weight[0, 0] += 1e-3  # a replica drifts, before the audit of this step is launched
            assert audit.step(step) is None  # launched: the verdict comes before the next optimizer step
        audit.close()
    except WeightDivergenceError as exc:
        raised_step, raised_covers = where, exc.result.step
    return {
        "raised_at": raised_step,
        "covers": raised_covers,
        "params": [p.detach().clone() for p in net.parameters()],
        "audits": audit.history.audits,
    }


def test_overlapped_audit_stays_silent_on_a_healthy_ddp_run_and_says_which_step_each_record_covers(
    tmp_path: Path,
) -> None:
    report = tmp_path / "r.jsonl"
    out = run_ranks(_train, 2, str(report), "raise", None)
    assert [o["raised_at"] for o in out] == [None, None]
    records = _records(report)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and all(r["in_sync"] for r in records)
    assert [r["overlap"]["covers_step"] for r in records] == [1, 2, 3, 4, 5, 6]
    # each settled before the next optimizer step; the last one at close
    assert [r["overlap"]["settled_at"] for r in records] == ["optimizer pre-step"] * 5 + ["settle"]


def test_overlapped_audit_finds_a_planted_divergence_and_names_the_step_it_covers(tmp_path: Path) -> None:
    report = tmp_path / "r.jsonl"
    run_ranks(_train, 2, str(report), "warn", 3, pinpoint=True)  # pinpoint's per-step digests compose with it
    records = _records(report)
    assert [r["in_sync"] for r in records] == [True, True, False, False, False, False]
    first = records[2]
    assert first["step"] == 3 and first["overlap"]["covers_step"] == 3 and first["action"] == "warned"
    assert first["mismatches"][0]["name"] == "0.weight" and first["mismatches"][0]["ranks"] == [1]
    assert first["first_diverged_step"] == 3 and first["pinpoint"] == "exact"


def test_overlapped_audit_raises_on_every_rank_at_the_next_optimizer_step(tmp_path: Path) -> None:
    report = tmp_path / "r.jsonl"
    out = run_ranks(_train, 2, str(report), "raise", 3)
    # the verdict for step 3 is raised out of step 4's optimizer.step(), before it writes anything
    assert [o["raised_at"] for o in out] == ["opt.step() of step 4"] * 2
    assert [o["covers"] for o in out] == [3, 3]
    last = _records(report)[-1]
    assert last["step"] == 3 and last["action"] == "raised" and not last["in_sync"]


def test_overlapped_audit_resyncs_to_bit_identical_replicas(tmp_path: Path) -> None:
    report = tmp_path / "r.jsonl"
    out = run_ranks(_train, 2, str(report), "resync", 3)
    records = _records(report)
    assert records[2]["step"] == 3 and records[2]["action"] == "resynced"
    assert all(r["in_sync"] for r in records[3:])
    for a, b in zip(out[0]["params"], out[1]["params"]):
        assert torch.equal(a, b)


def _ema_in_the_window(rank: int, world: int, report: str) -> dict:
    """Both ranks shrink a parameter in place right after launching the audit (outside the optimizer)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))  # a digest of ~12 MB
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    audit = LoopAudit(model, opt, every_n_steps=1, on_mismatch="raise", report_path=report, overlap=True)
    audit.runner.verbose = False
    for step in range(1, 4):
        opt.zero_grad()
        model(torch.ones(2, 1024)).sum().backward()
        opt.step()
        gate = _hold_the_worker(audit) if step == 2 else None
        audit.step(step)
        if gate is not None:
            with torch.no_grad():
                net[0].weight.mul_(0.5)  # while the worker reads it: must never be compared half-updated
            gate.set()
    audit.close()
    return {"params": [p.detach().clone() for p in net.parameters()]}


def test_a_write_outside_the_optimizer_inside_the_window_is_named_never_hashed_half_updated(tmp_path: Path) -> None:
    report = tmp_path / "r.jsonl"
    run_ranks(_ema_in_the_window, 2, str(report))
    records = _records(report)
    assert all(r["in_sync"] for r in records)  # no false alarm, no raise
    raced = records[1]
    assert raced["step"] == 2 and raced["overlap"] == {**raced["overlap"], "raced": True}
    assert any("0.weight written while the overlapped audit of step 2" in n for n in raced["notes"])
    assert "raced" not in records[0]["overlap"] and "raced" not in records[2]["overlap"]


def test_an_optimizer_with_a_closure_is_waited_for_after_its_forward_and_backward() -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=2)
    auditor = Auditor(model, opt)
    calls: list[str] = []

    def closure() -> torch.Tensor:
        calls.append("closure" if auditor.window is not None and auditor.window.pending is not None else "late")
        opt.zero_grad()
        loss = model(torch.ones(3, 4)).square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    pending = auditor.launch(step=1)
    before = len(calls)
    opt.step(closure)
    assert calls[before] == "closure"  # still pending while the closure ran: the wait came after it
    assert pending.result().overlap["settled_at"] == "optimizer pre-step, after its closure"
    auditor.close()


def test_an_audit_launched_after_the_structure_failed_to_prepare_raises_at_the_safe_point() -> None:
    model = torch.nn.Linear(4, 2, device="meta")
    auditor = Auditor(model)
    pending = auditor.launch(step=1)
    with pytest.raises(Exception, match="meta"):
        pending.result()
    auditor.close()


def test_the_overlap_field_round_trips_and_a_bad_one_is_named() -> None:
    r = AuditResult(in_sync=True, step=4, overlap={"covers_step": 4, "settled_at": "optimizer pre-step",
                                                   "waited_ms": 0.1, "audit_ms": 9.0})  # fmt: skip
    assert AuditResult.from_dict(r.to_dict()).overlap == r.overlap
    bad = {**r.to_dict(), "overlap": {"covers_step": 4, "settled_at": 3}}
    with pytest.raises(ReportFormatError, match="overlap.settled_at"):
        AuditResult.from_dict(bad)


def test_lightning_overlap_raises_at_the_next_update_after_the_closure_on_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    from lightning_helpers import Perturb, SmallModel, fit, records

    from weightsync_audit import WeightSyncAudit

    report = tmp_path / "audit.jsonl"
    drift = Perturb(1, 3, lambda trainer, module: module.net[0].weight[0, 0].add_(1e-3))  # before the launch
    audit = WeightSyncAudit(every_n_train_steps=1, overlap=True, on_mismatch="raise", report_path=str(report))
    with pytest.raises(Exception, match="WeightDivergenceError"):  # through ddp_fork's launcher
        fit(tmp_path, SmallModel(optimizer="adam"), [drift, audit], max_epochs=1)
    got = [r for r in records(report) if "overlap" in r]  # the train-start audit is synchronous
    assert [(r["step"], r["in_sync"]) for r in got] == [(1, True), (2, True), (3, False)]
    # raised by step 4's optimizer.step(), after its closure's forward and backward, before the update
    assert got[-1]["overlap"]["settled_at"] == "optimizer pre-step, after its closure"
    assert got[-1]["action"] == "raised"


def test_small_buffers_read_at_launch_do_not_race_with_the_next_forward() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.BatchNorm1d(2048))  # a 16 MiB weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    auditor = Auditor(model, opt)
    for step in range(1, 4):  # from the second audit on the manifest is cached: the small tensors read at launch
        opt.zero_grad()
        model(torch.randn(8, 2048)).square().mean().backward()
        opt.step()
        pending = auditor.launch(step=step)
        with torch.no_grad():  # what the next forward does to the running statistics, while the weight is read
            model[1].running_mean.add_(1.0)
            model[1].num_batches_tracked.add_(1)
        got = pending.result()
        assert got.in_sync
    assert "raced" not in got.overlap and not any("overlap:" in n for n in got.notes)
    auditor.close()


def test_overlap_must_be_a_bool_and_is_refused_at_construction_naming_it() -> None:
    with pytest.raises(TypeError, match="overlap='yes'"):
        LoopAudit(torch.nn.Linear(2, 2), overlap="yes")  # type: ignore[arg-type]


def test_the_race_guard_stamps_the_parameters_themselves_from_the_first_audit_on() -> None:
    """A write through the parameter (``p.clamp_()`` under ``no_grad``) moves the parameter's version counter: the
    guard sees it whether the manifest is the first one built or a cached one. A write through ``.data`` moves a
    counter of its own, which nothing audited holds: not seen (docs: decided at rest instead)."""
    from weightsync_audit.engine.explain.evidence import find_ddp
    from weightsync_audit.engine.overlap import RaceGuard

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 2))  # a weight of 256 KiB
    opt = torch.optim.Adam(model.parameters())
    auditor = Auditor(model, opt)
    model(torch.ones(2, 256)).sum().backward()
    opt.step()
    for built in ("first", "cached"):
        prepared = auditor.prepare(model, [opt], ddp=find_ddp(model))
        guard = RaceGuard(prepared)
        with torch.no_grad():
            model[0].weight.clamp_(-0.01, 0.01)
        assert any(t.data_ptr() == model[0].weight.data_ptr() for t in guard.moved()), built
        guard = RaceGuard(prepared)
        model[0].weight.data.mul_(0.5)
        assert not guard.moved(), built  # the limit the docs state
        auditor.audit(step=1)  # the next prepare reads the cached manifest


def _clamped(rank: int, world: int, how: str, report: str) -> dict[str, Any]:
    """WGAN's critic: every parameter clamped right after each optimizer step and the audit's launch, on every
    rank alike (healthy), while the worker digests a 4 MiB weight."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))
    model = DDP(net)
    opt = torch.optim.RMSprop(model.parameters(), lr=5e-3)
    audit = LoopAudit(model, opt, every_n_steps=1, report_path=report, overlap=True, verbose=False)
    weights = []
    for step in range(1, 11):
        opt.zero_grad()
        x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(step * 10 + rank))
        model(x).square().mean().backward()
        opt.step()
        audit.step(step)
        with torch.no_grad():
            for p in net.parameters():
                (p.data if how == ".data" else p).clamp_(-0.01 * (1 + step % 3), 0.01 * (1 + step % 3))
        weights.append([p.detach().clone() for p in net.parameters()])
    audit.close()
    return {"weights": weights}


@pytest.mark.parametrize("how", ["param", ".data"])
def test_a_post_step_clamp_inside_the_window_is_never_a_divergence(tmp_path: Path, how: str) -> None:
    report = tmp_path / "r.jsonl"
    out = run_ranks(_clamped, 2, how, str(report))
    # The truth, from the bytes: the replicas hold the same weights after every step.
    for a, b in zip(out[0]["weights"], out[1]["weights"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    records = _records(report)
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["step"] for r in records if not r["in_sync"]] == [], [r["notes"] for r in records if not r["in_sync"]]


def _lr_for_the_next_step(rank: int, world: int, report: str, optimizer: str) -> None:
    """Every rank writes a large weight in the window after step 2's launch (so that audit runs again at rest);
    rank 1 runs step 3 at ten times the learning rate, set before that safe point: by a pre-step hook, which
    runs before LBFGS's closure, or by the loop itself, before ``opt.step()``."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))  # 4 MB read on the worker
    model = DDP(net)
    closure_opt = optimizer == "lbfgs"
    opt = torch.optim.LBFGS(net.parameters(), lr=0.1, max_iter=1) if closure_opt else torch.optim.Adam(net.parameters())
    step = 0

    def ten_times(o: Any, *_: Any) -> None:  # registered before the library's: as a user's hook
        if rank == 1 and step == 3:
            o.param_groups[0]["lr"] *= 10

    def back(o: Any, *_: Any) -> None:
        if rank == 1 and step == 3:
            o.param_groups[0]["lr"] /= 10

    if closure_opt:
        opt.register_step_pre_hook(ten_times)
        opt.register_step_post_hook(back)
    audit = LoopAudit(model, opt, every_n_steps=1, on_mismatch="warn", report_path=report, overlap=True)
    audit.runner.verbose = False
    for step in range(1, 5):
        x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(step))

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss

        if not closure_opt and rank == 1 and step == 3:
            opt.param_groups[0]["lr"] *= 10  # and left there
        if closure_opt:
            opt.step(closure)
        else:
            closure()
            opt.step()
        gate = _hold_the_worker(audit) if step == 2 else None
        audit.step(step)
        if gate is not None:
            with torch.no_grad():
                net[0].weight.mul_(0.5)  # every rank alike, in the window: that audit runs again at rest
            gate.set()
    audit.close()


@pytest.mark.parametrize("optimizer", ["lbfgs", "adam"])
def test_an_audit_again_at_rest_compares_the_hyper_parameters_its_step_used_not_those_set_for_the_next(
    tmp_path: Path, optimizer: str
) -> None:
    report = tmp_path / "r.jsonl"
    run_ranks(_lr_for_the_next_step, 2, str(report), optimizer)
    records = _records(report)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    raced = records[1]
    assert raced["overlap"].get("raced") and raced["in_sync"], raced  # step 2 ran at the same lr everywhere
    third = records[2]
    assert not third["in_sync"] and third["mismatches"][0]["ranks"] == [1]  # step 3 did not: its update differs
    [lr] = [m for m in third["mismatches"] if m["name"] == "param_groups.0.lr"]  # as step 3 read it, on rank 1
    assert lr["ranks"] == [1]
    # LBFGS's lr was put back after its step: it differed as the step read it; Adam's was left
    assert str(lr["detail"]).startswith("differed as optimizer step 3") == (optimizer == "lbfgs"), lr
