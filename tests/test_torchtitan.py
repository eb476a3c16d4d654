"""torchtitan's ParallelDims read into the audit's peer sets, on 4 real gloo ranks (issue 33, item 2).

torchtitan 0.3 asks torch for a ``fake`` backend on its singleton mesh dimensions; torch 2.13 registers it
only through its testing package, imported here as torchtitan's own CPU tests would need. The meshes are
built by torchtitan itself; the peer sets must equal its groups, and a pipeline layout declared from them
compares each stage within its replicas (a plain audit compares different stages and cries wolf).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

parallel_dims = pytest.importorskip("torchtitan.distributed.parallel_dims")
import torch.testing._internal.distributed.fake_pg  # noqa: E402 - registers the "fake" backend

from weightsync_audit import audit  # noqa: E402
from weightsync_audit.engine.inventory.layouts import declare_torchtitan, torchtitan_peer_sets  # noqa: E402

LAYOUTS = [
    {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "pp": 1, "ep": 1},
    {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 2, "ep": 1},
    {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1, "pp": 1, "ep": 1},
    {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1, "pp": 1, "ep": 2},
    {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1, "ep": 1},
]


def _peer_sets(rank: int, world: int) -> list[dict[str, Any]]:
    out = []
    for dims in LAYOUTS:
        pd = parallel_dims.ParallelDims(**dims, world_size=world)
        peers = torchtitan_peer_sets(pd)
        meshes = pd.get_all_one_dimensional_meshes()
        out.append({"peers": peers, "from_meshes": {n: sorted(m.mesh.flatten().tolist()) for n, m in meshes.items()}})
    return out


def test_peer_sets_are_torchtitans_mesh_groups_and_the_stage_is_the_ranks_sharing_the_pp_coordinate() -> None:
    results = run_ranks(_peer_sets, 4, timeout=120)
    for rank, rows in enumerate(results):
        for dims, row in zip(LAYOUTS, rows):
            peers = row["peers"]
            for name, ranks in row["from_meshes"].items():
                assert list(peers[name]) == ranks and rank in ranks, (rank, dims, name, peers)
            for name, degree in (("tp", dims["tp"]), ("cp", dims["cp"]), ("pp", dims["pp"]), ("ep", dims["ep"])):
                assert len(peers.get(name, (rank,))) == degree, (rank, dims, name, peers)
            stage = peers["stage"]
            assert rank in stage and len(stage) == 4 // dims["pp"], (rank, dims, stage)
            if "pp" in peers:  # the stage holds exactly one rank of each pipeline group
                assert len(set(stage) & set(peers["pp"])) == 1, (rank, dims, peers)


def _pipeline(rank: int, world: int) -> dict[str, Any]:
    pd = parallel_dims.ParallelDims(dp_replicate=2, dp_shard=1, cp=1, tp=1, pp=2, ep=1, world_size=world)
    peers = torchtitan_peer_sets(pd)
    stage = peers["pp"].index(rank)
    torch.manual_seed(stage)
    part = nn.Linear(8, 8)  # stage 0 and stage 1 hold different layers under the same local names
    plain = audit(part, timeout_s=10)
    declare_torchtitan(part, pd)
    healthy = audit(part, timeout_s=10)
    if rank == 3:
        with torch.no_grad():
            part.weight[0, 0] += 1
    drifted = audit(part, timeout_s=10)
    dist.barrier()
    return {
        "plain_in_sync": plain.in_sync,
        "healthy": healthy.in_sync,
        "checked": healthy.to_dict()["checked"]["param"],
        "drifted": [(m.name, m.ranks) for m in drifted.mismatches],
    }


def test_a_torchtitan_pipeline_declared_from_its_dims_compares_each_stage_within_its_replicas() -> None:
    for rank, r in enumerate(run_ranks(_pipeline, 4, timeout=120)):
        assert not r["plain_in_sync"], (rank, r)  # without the declaration: the stages differ by design
        assert r["healthy"] and r["checked"] == 4, (rank, r)
        stage_of_3 = 1  # pp groups are (0, 2) and (1, 3): rank 3 holds stage 1 with rank 2
        assert r["drifted"] == [(f"stage{stage_of_3}.weight", [3])], (rank, r)


TITAN_DTENSOR_LAYOUTS = {  # pp=2 with DTensor parameters on torchtitan's own meshes (issue 43, item 3)
    "fsdp": {"dp_replicate": 1, "dp_shard": 2, "tp": 1},  # FSDP2 on dp_shard: every piece has one owner
    "hsdp": {"dp_replicate": 2, "dp_shard": 1, "tp": 1},  # HSDP: each stage's shard replicated on dp_replicate
    "tp": {"dp_replicate": 1, "dp_shard": 1, "tp": 2},  # Colwise + Rowwise: the Rowwise bias is Replicate
}


def _identity(stage: int, t: torch.Tensor) -> tuple[Any, ...]:
    """Which copy of a tensor a rank holds, from torch's own DTensor placements and torchtitan's pp mesh: the
    stage, and a DTensor's coordinates on the mesh dimensions it is not replicated along."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return (stage,)
    coord = t.device_mesh.get_coordinate()
    return (stage, *[(d, coord[d]) for d, pl in enumerate(t.placements) if not pl.is_replicate()])


def _copies(part: nn.Module, stage: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    held = {}
    for name, p in part.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        held[f"stage{stage}.{name}"] = (_identity(stage, p), local.detach().clone())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, held)
    return {"every": every}


def _apart(every: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(name, rank) for each copy whose bytes differ from another holder of the same copy (the truth)."""
    out = []
    for r, held in enumerate(every):
        for name, (ident, t) in held.items():
            peers = [q for q in range(len(every)) if q != r and every[q].get(name, (None,))[0] == ident]
            if any(not torch.equal(t, every[q][name][1]) for q in peers):
                out.append((name, r))
    return sorted(out)


def _replicated(every: list[dict[str, Any]]) -> int:
    """How many parameter names have a copy held by two ranks or more (what the audit can compare)."""
    seen: dict[tuple[str, Any], int] = {}
    for held in every:
        for name, (ident, _) in held.items():
            seen[(name, ident)] = seen.get((name, ident), 0) + 1
    return len({name for (name, _), n in seen.items() if n > 1})


def _titan_dtensors(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from weightsync_audit import LoopAudit, resync

    parallel_dims.device_type = "cpu"  # torchtitan's meshes say "cuda" on a machine without one
    out: dict[str, Any] = {}
    for how, dims in TITAN_DTENSOR_LAYOUTS.items():
        pd = parallel_dims.ParallelDims(**dims, cp=1, pp=2, ep=1, world_size=world)
        stage = pd.get_mesh("pp").get_local_rank()
        torch.manual_seed(stage)  # each stage its own layers, under the same local names
        part = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        if how == "tp":
            parallelize_module(part, pd.get_mesh("tp"), {"1": ColwiseParallel(), "3": RowwiseParallel()})
        else:
            fully_shard(part, mesh=pd.get_optional_mesh(["dp_replicate", "dp_shard"], include_singleton_axes=True))
        part = declare_torchtitan(part, pd)
        opt = torch.optim.SGD(part.parameters(), lr=0.1)
        row: dict[str, Any] = {}
        with LoopAudit(part, opt, every_n_steps=1, on_mismatch="raise", timeout_s=20, verbose=False) as weights:
            for step in (1, 2):  # a healthy run under raise: no false alarm stops it
                opt.zero_grad()
                part(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + stage))).sum().backward()
                opt.step()
                row[f"step {step}"] = weights.step(step).to_dict()
        row["healthy"] = _copies(part, stage)
        if rank == 3:  # stage 1: its LayerNorm (plain) and the last layer's bias (Replicate under TP)
            with torch.no_grad():
                for p in (part[0].weight, part[3].bias):
                    (p.to_local() if hasattr(p, "to_local") else p)[0] += 0.5
        row["planted"] = audit(part, opt, timeout_s=20).to_dict()
        row["before"] = _copies(part, stage)
        resync(part, opt)  # world-wide
        row["after"] = _copies(part, stage)
        out[how] = row
    return out


@pytest.fixture(scope="module")
def titan_dtensor_runs() -> list[dict[str, Any]]:
    return run_ranks(_titan_dtensors, 4, timeout=240)


@pytest.mark.parametrize("how", list(TITAN_DTENSOR_LAYOUTS))
def test_pp2_with_dtensor_parameters_declared_from_torchtitan_compares_within_each_stage(
    titan_dtensor_runs: list, how: str
) -> None:
    every = titan_dtensor_runs[0][how]["healthy"]["every"]
    compared = _replicated(every)
    assert compared == {"fsdp": 0, "hsdp": 12, "tp": 6}[how], compared  # the truth, from the placements
    assert _apart(every) == []
    for rank, out in enumerate(titan_dtensor_runs):
        for step in (1, 2):  # on_mismatch="raise": the healthy run went on, and each audit says in sync
            rec = out[how][f"step {step}"]
            assert rec["in_sync"] and rec["checked"]["param"] == compared, (rank, how, step, rec["mismatches"])
    # The truth after rank 3's plant: the copies of ranks 2 and 3 (stage 1's two replicas) differ; with two
    # replicas the tie goes to the lower rank, so the record names rank 3 against rank 2.
    apart = _apart(titan_dtensor_runs[0][how]["before"]["every"])
    names = sorted({name for name, _ in apart})
    assert len(names) == {"fsdp": 0, "hsdp": 2, "tp": 2}[how] and {r for _, r in apart} <= {2, 3}, apart
    for out in titan_dtensor_runs:
        rec = out[how]["planted"]
        found = sorted((m["name"], m["ranks"], m["reference_ranks"]) for m in rec["mismatches"])
        assert found == [(name, [3], [2]) for name in names], (how, found)
    assert _apart(titan_dtensor_runs[0][how]["after"]["every"]) == []  # a world-wide resync heals each stage
