"""FSDP1 on CPU gloo: a world-wide audit with no ``group=`` compares what has replicas and says what has not.

FULL_SHARD / SHARD_GRAD_OP: flat-parameter shards have one owner (named in the note, never counted),
buffers and scalars are compared; HYBRID_SHARD (flat, or uneven pieces with ``use_orig_params=True``) and
_HYBRID_SHARD_ZERO2: shards compared within their replicate group, without ``group=``; NO_SHARD: like DDP.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ranks import run_ranks


def _train(world: int, strategy: str, orig: bool) -> tuple[Any, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    kwargs: dict[str, Any] = {}
    if "HYBRID" in strategy:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    m = FSDP(
        model,
        sharding_strategy=getattr(ShardingStrategy, strategy),
        device_id=torch.device("cpu"),
        use_orig_params=orig,
        **kwargs,
    )
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    m(torch.randn(4, 8)).sum().backward()  # the same batch everywhere: BatchNorm's running stats stay replicas
    opt.step()
    dist.barrier()
    return m, opt


def _train_and_audit(rank: int, world: int, strategy: str, orig: bool, plant: str | None) -> dict[str, Any]:
    from weightsync_audit import audit

    m, opt = _train(world, strategy, orig)
    if plant is not None and rank == world - 1:
        with torch.no_grad():
            if plant == "param":
                next(iter(m.parameters())).data.view(-1)[0] += 1.0
            else:
                dict(m.named_buffers())[plant].add_(1.0)
    return audit(m, opt).to_dict()


def _names(rec: dict[str, Any]) -> list[tuple[str, list[int]]]:
    return [(x["name"], x["ranks"]) for x in rec["mismatches"]]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp1_full_shard_compares_buffers_and_scalars_and_names_shards_as_unreplicated(strategy: str) -> None:
    clean, planted, buffer = (
        run_ranks(_train_and_audit, 2, strategy, False, plant)
        for plant in (None, "param", "_fsdp_wrapped_module.1.running_mean")
    )
    for rec in clean + planted:
        assert rec["in_sync"], rec  # a shard has one owner: a change in rank 1's shard is no divergence
        assert rec["checked"]["param"] == 0 and rec["checked"]["buffer"] == 3 and rec["checked"]["optimizer"] > 0
        assert any("3 tensors have no replica to compare (3 FSDP1 shards)" in n for n in rec["notes"]), rec["notes"]
    assert clean[0] == {**clean[1], "duration_ms": clean[0]["duration_ms"], "time": clean[0]["time"]}
    assert not buffer[0]["in_sync"] and _names(buffer[0]) == [("1.running_mean", [1])]


def test_fsdp1_full_shard_with_orig_params_has_no_structure_false_alarm() -> None:
    recs = run_ranks(_train_and_audit, 2, "FULL_SHARD", True, None)
    # Uneven 1-D pieces (some empty, so some ranks hold no Adam state for a parameter): no structure alarm.
    assert all(r["in_sync"] and r["checked"]["param"] == 0 for r in recs), recs
    assert recs[0]["notes"][0].startswith("18 tensors have no replica to compare (18 FSDP1 shards)"), recs[0]["notes"]
    assert recs[0]["notes"] == recs[1]["notes"] and recs[0]["checked"] == recs[1]["checked"]


HYBRID = {
    "flat": ("HYBRID_SHARD", False),
    "use_orig_params": ("HYBRID_SHARD", True),
    "zero2_flat": ("_HYBRID_SHARD_ZERO2", False),
}


def _hybrid(rank: int, world: int) -> dict[str, Any]:
    """One launch, every layout: flat shards (``use_orig_params=False``), uneven 1-D pieces (``True``), and
    ``_HYBRID_SHARD_ZERO2``; each audited healthy, then with the first value of rank 3's shard moved by 1."""
    from weightsync_audit import audit

    out: dict[str, Any] = {}
    for case, (strategy, orig) in HYBRID.items():
        m, opt = _train(world, strategy, orig)
        out[f"{case}.clean"] = audit(m, opt).to_dict()
        # use_orig_params=True: 2.weight's piece is empty on shard 0 and 64 values on shard 1 (ranks 1, 3).
        p = dict(m.named_parameters())["_fsdp_wrapped_module.2.weight"] if orig else next(m.parameters())
        t = p.data.view(-1)
        saved = t[:1].clone()
        if rank == world - 1:
            t[:1] += 1.0
        out[f"{case}.param"] = audit(m, opt).to_dict()
        t[:1].copy_(saved)
    return out


@pytest.fixture(scope="module")
def hybrid() -> list[dict[str, Any]]:
    return run_ranks(_hybrid, 4)


@pytest.mark.parametrize("case", list(HYBRID))
def test_fsdp1_hybrid_shard_compares_each_shard_within_its_replicate_group_without_group(
    hybrid: list[dict[str, Any]], case: str
) -> None:
    orig = HYBRID[case][1]
    clean = [r[f"{case}.clean"] for r in hybrid]
    n = 6 if orig else 1  # the original parameters' pieces, or the one flat parameter
    assert all(r["in_sync"] and r["checked"]["param"] == n and not r.get("notes") for r in clean), clean
    planted = [r[f"{case}.param"] for r in hybrid]
    rec = planted[0]
    name = "2.weight" if orig else "_flat_param"
    assert not rec["in_sync"] and _names(rec) == [(name, [3])], rec
    bad = rec["mismatches"][0]
    assert bad["reference_ranks"] == [1] and bad["shard"] == {"shard": 1} and bad["max_abs_diff"] == 1.0, bad
    assert all(r["mismatches"] == rec["mismatches"] for r in planted)


def test_fsdp1_no_shard_is_compared_like_ddp() -> None:
    recs = run_ranks(_train_and_audit, 2, "NO_SHARD", False, "param")
    assert not recs[0]["in_sync"] and [m["ranks"] for m in recs[0]["mismatches"]] == [[1]]
    assert recs[0]["checked"]["param"] == 1 and not any("no replica" in n for n in recs[0].get("notes", []))


def test_fsdp1_hybrid_resync_copies_a_shard_only_within_its_replicate_group() -> None:
    def fn(rank: int, world: int) -> list[Any]:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        from weightsync_audit import audit, resync

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        m = FSDP(
            model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"), device_mesh=mesh
        )
        flat = next(iter(m.parameters())).data
        before = flat.clone()
        if rank == 3:
            flat[0] += 1.0
        dist.barrier()
        resync(m)  # src=0 holds shard 0 only: shard 1 comes from its own replicate group
        return [audit(m).in_sync, torch.equal(flat, before)]

    out = run_ranks(fn, 4)
    assert [o[0] for o in out] == [True] * 4
    assert [o[1] for o in out] == [True, True, True, True], out  # rank 3 got rank 1's shard back


# -- issue 30: state held by some ranks only ---------------------------------------------------------------


def _lost_state(rank: int, world: int, orig: bool) -> dict[str, Any]:
    """Healthy, then rank 1's optimizer state lost (a fresh optimizer state, as after a failed load)."""
    import torch.distributed as dist

    from weightsync_audit import audit

    m, opt = _train(world, "FULL_SHARD", orig)
    fresh = torch.optim.Adam(m.parameters(), lr=1e-2)  # before any step: no state on any rank
    out = {"healthy": audit(m, opt).to_dict(), "fresh": audit(m, fresh).to_dict()}
    if rank == 1:
        opt.state.clear()
    held = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(held, torch.tensor([len(opt.state)]))  # the truth: how many parameters have state, per rank
    out["held"] = [int(h) for h in held]
    out["lost"] = audit(m, opt).to_dict()
    return out


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "use_orig_params"])
def test_fsdp1_full_shard_a_rank_that_lost_its_optimizer_state_is_not_in_sync(orig: bool) -> None:
    r0, r1 = run_ranks(_lost_state, 2, orig)
    assert r0["held"][0] > 0 and r0["held"][1] == 0, r0["held"]  # rank 0 holds state (a replicated step too)
    assert r0["healthy"]["in_sync"] and r0["fresh"]["in_sync"], (r0["healthy"], r0["fresh"])
    lost = r0["lost"]
    assert not lost["in_sync"] and lost["mismatches"] == r1["lost"]["mismatches"], lost
    names = [(m["name"], m["kind"], m["ranks"]) for m in lost["mismatches"]]
    first = "_flat_param" if not orig else "0.weight"  # the one parameter both ranks hold a piece of
    assert names == [(f"fsdp1.optimizer_state_held.{first}", "optimizer", [1])], names


def _grads(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from weightsync_audit import audit

    m, opt = _train(world, "FULL_SHARD", True)
    m(torch.randn(4, 8)).sum().backward()
    empty = [n for n, p in m.named_parameters() if p.numel() == 0]
    rec = audit(m, opt, include=("params", "buffers", "optimizer", "grads")).to_dict()
    equal = []
    with FSDP.summon_full_params(m):  # the truth: every full parameter, gathered and compared byte for byte
        for p in m.parameters():
            got = [torch.zeros_like(p) for _ in range(world)]
            dist.all_gather(got, p.detach().contiguous())
            equal.append(all(torch.equal(got[0], g) for g in got))
    return {"empty": empty, "rec": rec, "equal": equal}


def test_fsdp1_use_orig_params_with_grads_an_empty_piece_without_a_grad_is_no_structure_difference() -> None:
    r0, r1 = run_ranks(_grads, 2)
    assert r0["empty"] or r1["empty"], "the case needs a rank whose piece of a parameter is empty"
    assert all(r0["equal"]), r0["equal"]
    for r in (r0, r1):
        assert r["rec"]["in_sync"] and not r["rec"]["mismatches"], r["rec"]["mismatches"]


def _resync(rank: int, world: int, lose: bool) -> dict[str, Any]:
    import time

    import torch.distributed as dist

    from weightsync_audit import audit, resync

    m, opt = _train(world, "FULL_SHARD", not lose)
    buf = dict(m.named_buffers())["_fsdp_wrapped_module.1.running_mean"]
    if rank == 1:
        with torch.no_grad():
            buf.add_(1.0)
        if lose:
            opt.state.clear()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    t0 = time.monotonic()
    try:
        resync(m, opt, src=0, timeout_s=20)
        error = None
    except ValueError as exc:
        error = str(exc)
    took = time.monotonic() - t0
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)  # the truth: the buffer, gathered
    untouched = len(before) == len(opt.state) and all(
        set(s) == set(opt.state[p]) and all(torch.equal(v, opt.state[p][k]) for k, v in s.items())
        for p, s in ((p, before[id(p)]) for p in opt.state)
    )
    return {"error": error, "took": took, "buffers_equal": torch.equal(bufs[0], bufs[1]), "state_untouched": untouched,
            "after": audit(m, opt).to_dict()}  # fmt: skip


def test_fsdp1_use_orig_params_resync_repairs_a_buffer_and_never_touches_shard_state() -> None:
    r0, r1 = run_ranks(_resync, 2, False, timeout=60)
    for r in (r0, r1):
        assert r["error"] is None and r["took"] < 15, r  # every rank ends together, no timeout waited out
        assert r["buffers_equal"] and r["state_untouched"] and r["after"]["in_sync"], r


def test_fsdp1_resync_of_a_lost_shard_state_is_refused_on_every_rank_before_anything_moves() -> None:
    r0, r1 = run_ranks(_resync, 2, True, timeout=60)
    for r in (r0, r1):
        assert r["error"] is not None and "fsdp1.optimizer_state_held._flat_param" in r["error"], r
        assert "no replica" in r["error"] and r["took"] < 15 and r["state_untouched"], r
        assert not r["buffers_equal"]  # nothing moved: the buffer too stays as it was
    assert r0["error"] == r1["error"]


def _pinpoint(rank: int, world: int, strategy: str, orig: bool) -> dict[str, Any]:
    """Steps 1-8; rank ``world - 1`` changes a buffer (or, HYBRID, its shard) in step 6; audits at 3 and 8."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    from weightsync_audit import Auditor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    kwargs: dict[str, Any] = {}
    if "HYBRID" in strategy:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    m = FSDP(model, sharding_strategy=getattr(ShardingStrategy, strategy), device_id=torch.device("cpu"),
             use_orig_params=orig, **kwargs)  # fmt: skip
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    auditor = Auditor(m, opt, pinpoint=True)
    target = dict(m.named_buffers())["_fsdp_wrapped_module.1.running_mean"]
    if "HYBRID" in strategy:
        target = next(m.parameters()).data  # this rank's flat shard, replicated across its replicate group
    truth, out = None, {}
    for step in range(1, 9):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))  # the same batch everywhere
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 6 and rank == world - 1:
            with torch.no_grad():
                target.view(-1)[0] += 1.0
        got = [torch.zeros_like(target) for _ in range(world)]
        dist.all_gather(got, target.contiguous())  # the truth: the first step at which the bytes differ
        pairs = [(0, 2), (1, 3)] if "HYBRID" in strategy else [(0, r) for r in range(1, world)]  # replicas
        if truth is None and not all(torch.equal(got[a], got[b]) for a, b in pairs):
            truth = step
        auditor.record_step(step)
        if step == 3:
            out["step3"] = auditor.audit(step=3).to_dict()
    out["step8"] = auditor.audit(step=8).to_dict()
    out["truth"] = truth
    return out


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "use_orig_params"])
def test_fsdp1_pinpoint_dates_a_buffer_change_from_what_every_rank_holds_whole(orig: bool) -> None:
    r0, r1 = run_ranks(_pinpoint, 2, "FULL_SHARD", orig)
    assert r0["truth"] == 6, r0["truth"]
    for r in (r0, r1):
        early = r["step3"]  # each rank's own shards never feed the rings: no transient false alarm
        assert early["in_sync"] and early.get("transient") is None, early
        rec = r["step8"]
        assert not rec["in_sync"] and [m["name"] for m in rec["mismatches"]] == ["1.running_mean"], rec
        assert (rec["pinpoint"], rec["first_diverged_step"], rec["last_in_sync_step"]) == ("exact", 6, 5), rec


def test_fsdp1_hybrid_pinpoint_of_a_shard_divergence_says_unavailable_and_why() -> None:
    out = run_ranks(_pinpoint, 4, "HYBRID_SHARD", False)
    assert out[0]["truth"] == 6, out[0]["truth"]
    rec = out[0]["step8"]  # the changed shard, and the BatchNorm statistics it then moved on its ranks
    assert next((m["name"], m["ranks"]) for m in rec["mismatches"]) == ("_flat_param", [3]), rec["mismatches"]
    assert rec["pinpoint"] == "unavailable" and rec.get("first_diverged_step") is None, rec
    assert any(n.startswith("pinpoint unavailable: _flat_param is held in pieces") for n in rec["notes"]), rec["notes"]
    assert all(r["step8"]["notes"] == rec["notes"] and r["step3"]["in_sync"] for r in out)
