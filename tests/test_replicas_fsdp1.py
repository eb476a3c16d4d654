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
