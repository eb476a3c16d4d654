"""The engine on real gloo process groups (2 and 4 ranks), with and without DDP."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from dtypes import ALL_DTYPES
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from weightsync_audit import Auditor, audit, resync


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train_steps(rank: int, world: int, opt_name: str, use_ddp: bool, steps: int = 20) -> list[bool]:
    model = make_model()
    net = DDP(model) if use_ddp else model
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if opt_name == "sgd"
        else torch.optim.Adam(model.parameters(), lr=1e-3)
    )
    auditor = Auditor(net, opt)
    torch.manual_seed(100 + rank)  # each rank sees its own data
    verdicts = []
    for step in range(steps):
        x = torch.randn(4, 8)
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if not use_ddp:  # a hand-written data-parallel step: average grads
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        verdicts.append(auditor.audit(step=step).in_sync)
    return verdicts


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("use_ddp", [True, False])
def test_in_sync_training_never_raises_a_false_alarm(world: int, opt_name: str, use_ddp: bool) -> None:
    results = run_ranks(train_steps, world, opt_name, use_ddp)
    assert all(all(v) for v in results), results


def _one_ulp(rank: int, world: int, odd: int, use_ddp: bool) -> dict:
    model = make_model()
    net = DDP(model) if use_ddp else model
    if rank == odd:
        with torch.no_grad():
            w = model[2].weight
            w[1, 3] = torch.nextafter(w[1, 3], torch.tensor(math.inf))
    r = audit(net, step=7, epoch=1)
    return r.to_dict()


@pytest.mark.parametrize("world,odd", [(2, 1), (4, 2), (4, 0)])
@pytest.mark.parametrize("use_ddp", [True, False])
def test_one_ulp_on_one_rank_is_found_with_name_kind_ranks_and_step(world: int, odd: int, use_ddp: bool) -> None:
    records = run_ranks(_one_ulp, world, odd, use_ddp)
    for rec in records:
        rec.pop("time")
        rec.pop("duration_ms")
    assert all(r == records[0] for r in records), "every rank must reach the same verdict"
    rec = records[0]
    assert rec["in_sync"] is False and rec["step"] == 7 and rec["epoch"] == 1
    [m] = rec["mismatches"]
    assert m["name"] == "2.weight" and m["kind"] == "param"
    expected_odd = [odd] if world > 2 else [1]  # with 2 ranks the tie goes to rank 0
    assert m["ranks"] == expected_odd
    assert m["reference_ranks"] == [r for r in range(world) if r not in expected_odd]
    assert m["shape"] == [4, 16] and m["dtype"] == "float32"
    assert 0 < m["max_abs_diff"] < 1e-6


def _optimizer_state(rank: int, world: int) -> dict:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    if rank == 1:
        opt.state[model[0].weight]["exp_avg_sq"][0, 0] += 1.0
    return audit(model, opt, step=1).to_dict()


def test_optimizer_state_changed_on_one_rank_is_reported_as_optimizer_not_param() -> None:
    rec = run_ranks(_optimizer_state, 2)[0]
    assert [(m["name"], m["kind"], m["ranks"]) for m in rec["mismatches"]] == [
        ("0.weight.exp_avg_sq", "optimizer", [1])
    ]
    assert rec["mismatches"][0]["max_abs_diff"] == pytest.approx(1.0)
    assert any("Optimizer state differs" in h for h in rec["hints"])


def _lr_differs(rank: int, world: int) -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 if rank != 2 else 0.2)
    return audit(model, opt).to_dict()


def test_learning_rate_differing_on_one_of_four_ranks_names_the_param_group() -> None:
    rec = run_ranks(_lr_differs, 4)[0]
    [m] = rec["mismatches"]
    assert (m["name"], m["kind"], m["ranks"], m["reference_ranks"]) == (
        "param_groups.0.lr",
        "optimizer",
        [2],
        [0, 1, 3],
    )
    assert m["max_abs_diff"] == pytest.approx(0.1)
    assert any("learning rate differs" in h for h in rec["hints"])


def _structure(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Linear(16, 4)]
    if rank == 1:
        layers.append(nn.Linear(4, 2))  # an extra layer
        layers[0] = nn.Linear(8, 16, bias=False)  # a missing bias
        torch.manual_seed(0)
    model = nn.Sequential(*layers)
    if rank == 1:
        with torch.no_grad():
            torch.manual_seed(0)
            model[0].weight.copy_(nn.Linear(8, 16).weight)
            model[1].weight.add_(1.0)
    model2 = nn.Sequential(*layers)
    buf = torch.zeros(3, dtype=torch.float32 if rank == 0 else torch.float64)
    model2.register_buffer("stat", buf)
    return audit(model2, step=3).to_dict()


def test_models_that_differ_in_structure_are_reported_as_structure_not_a_crash() -> None:
    recs = run_ranks(_structure, 2)
    rec = recs[0]
    assert recs[0]["mismatches"] == recs[1]["mismatches"]
    by_name = {m["name"]: m for m in rec["mismatches"]}
    assert by_name["0.bias"]["kind"] == "structure" and "missing on rank 1" in by_name["0.bias"]["detail"]
    assert by_name["2.weight"]["kind"] == "structure" and "present only on rank" in by_name["2.weight"]["detail"]
    assert by_name["stat"]["kind"] == "structure" and "dtype float64 instead of float32" in by_name["stat"]["detail"]
    # a value difference in a tensor whose structure agrees is still found
    assert by_name["1.weight"]["kind"] == "param" and by_name["1.weight"]["max_abs_diff"] == pytest.approx(1.0)
    assert "0.weight" not in by_name


DTYPES = ALL_DTYPES


def _all_dtypes(rank: int, world: int) -> dict:
    m = nn.Module()
    for i, dt in enumerate(DTYPES):
        base = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
        t = base.to(dt) if dt != torch.bool else base > 1
        m.register_buffer(f"b{i}", t)
        m.register_buffer(f"t{i}", t.t())  # non-contiguous
        m.register_buffer(f"s{i}", t[1, 2].clone())  # 0-dim
        m.register_buffer(f"e{i}", t[:0])  # empty
    if rank == 1:
        for i, dt in enumerate(DTYPES):
            raw = getattr(m, f"t{i}").view(torch.uint8) if dt.itemsize == 1 else None
            # flip one bit of one element of the transposed (non-contiguous) copy
            b = getattr(m, f"b{i}")
            flipped = b.clone().contiguous()
            u8 = flipped.view(torch.uint8).view(-1)
            u8[5] ^= 1
            setattr(m, f"t{i}", flipped.t())
            del raw
    return audit(m, step=0).to_dict()


def test_every_dtype_layout_and_shape_is_audited_and_a_single_bit_is_found() -> None:
    rec = run_ranks(_all_dtypes, 2)[0]
    names = sorted(mm["name"] for mm in rec["mismatches"])
    assert names == sorted(f"t{i}" for i in range(len(DTYPES))), names
    assert rec["checked"]["buffer"] == 4 * len(DTYPES)
    assert all(mm["kind"] == "buffer" and mm["ranks"] == [1] for mm in rec["mismatches"])


def _resync(rank: int, world: int, use_ddp: bool) -> tuple[bool, bool, list[str], bool]:
    model = make_model(seed=rank)  # every rank different
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (rank + 1))
    torch.manual_seed(rank)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    net = DDP(model, broadcast_buffers=False) if use_ddp else model
    if use_ddp:  # DDP's construction broadcast made params equal: break them again
        with torch.no_grad():
            model[0].weight.add_(rank)
    before = audit(net, opt)
    resync(net, opt, src=0)
    after = audit(net, opt)
    # bit-identical to rank 0: compare against rank 0's bytes
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    same = torch.equal(flat.view(torch.int32), ref.view(torch.int32))
    return before.in_sync, after.in_sync, after.diverged_names, same and opt.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("use_ddp", [True, False])
def test_resync_makes_every_replica_bit_identical_to_the_source(world: int, use_ddp: bool) -> None:
    for before, after, names, identical in run_ranks(_resync, world, use_ddp):
        assert before is False
        assert after is True, names
        assert identical


def _resync_missing_state(rank: int, world: int) -> tuple[bool, int]:
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    if rank == 0:  # only the source has stepped: the others have no optimizer state at all
        model(torch.ones(1, 8)).sum().backward()
        opt.step()
    resync(model, opt, src=0)
    return audit(model, opt).in_sync, len(opt.state)


def test_resync_creates_optimizer_state_that_exists_on_the_source_only() -> None:
    for in_sync, n_state in run_ranks(_resync_missing_state, 2):
        assert in_sync and n_state == 4


def test_world_of_one_without_a_process_group_is_in_sync() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    r = audit(model, opt, step=5)
    assert r.in_sync and r.world_size == 1 and r.checked == {"param": 4, "buffer": 0, "optimizer": 4 + 9, "grad": 0}


def _world_of_one(rank: int, world: int) -> bool:
    return audit(make_model()).in_sync


def test_world_of_one_with_a_process_group() -> None:
    assert run_ranks(_world_of_one, 1) == [True]


def _meta_on_one_rank(rank: int, world: int) -> str:
    from weightsync_audit import AuditPreparationError, UnauditableTensorError

    model = make_model()
    if rank == 2:
        model.register_buffer("lazy", torch.empty(3, device="meta"))
    try:
        audit(model, timeout_s=30)
    except UnauditableTensorError as exc:
        return f"own: {exc}"
    except AuditPreparationError as exc:
        return f"peer: {exc}"
    return "no error"


def test_a_rank_that_cannot_prepare_its_audit_makes_every_rank_raise_at_once_not_wait() -> None:
    import time

    t0 = time.monotonic()
    out = run_ranks(_meta_on_one_rank, 4, timeout=60)
    assert time.monotonic() - t0 < 20, "nobody waited for the deadline"
    assert out[2].startswith("own:") and "'lazy'" in out[2] and "meta" in out[2]
    for r in (0, 1, 3):
        assert out[r].startswith("peer:") and "rank 2" in out[r] and "'lazy'" in out[r]


def _resync_extra_state(rank: int, world: int) -> tuple[bool, int]:
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    if rank == 1:  # only a non-source rank has stepped: its optimizer state must go
        model(torch.ones(1, 8)).sum().backward()
        opt.step()
    resync(model, opt, src=0)
    return audit(model, opt).in_sync, len(opt.state)


def test_resync_drops_optimizer_state_the_source_does_not_have() -> None:
    assert run_ranks(_resync_extra_state, 2) == [(True, 0), (True, 0)]
