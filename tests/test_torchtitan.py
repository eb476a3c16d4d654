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
from weightsync_audit.integrations.torchtitan import declare_torchtitan, torchtitan_peer_sets  # noqa: E402

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
