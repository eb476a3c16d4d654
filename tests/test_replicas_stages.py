"""Pipeline stages and expert groups, named once with ``declare_replicas``: a world-wide audit with no
``group=`` compares each stage within its data-parallel group and each expert within its holders."""

from __future__ import annotations

from typing import Any

import torch

from tests.ranks import run_ranks


def _stage_audit(rank: int, world: int, how: str, plant: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from weightsync_audit import audit, declare_replicas

    stage = rank % 2  # a (dp=2, pp=2) grid: stage 0 on ranks 0 and 2, stage 1 on ranks 1 and 3
    groups = [dist.new_group([s, s + 2]) for s in range(2)]  # every rank creates every group, in order
    torch.manual_seed(stage)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16)) if stage == 0 else torch.nn.Sequential(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.randn(2, module[0].in_features)).sum().backward()
    opt.step()
    if how == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        declare_replicas(module, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")))
    else:
        declare_replicas(module, stage=stage, stage_group=groups[stage])
    if plant and rank == 3:
        with torch.no_grad():
            module[0].weight[0, 0] += 1.0
    return audit(module, opt).to_dict()


def _expert_audit(rank: int, world: int, plant: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from weightsync_audit import audit, declare_replicas

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ep = mesh.get_coordinate()[1]
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"dense": torch.nn.Linear(4, 4), "experts": torch.nn.ModuleList([torch.nn.Linear(4, 4)])}
    )
    torch.manual_seed(100 + ep)  # each expert-parallel coordinate holds different experts
    model["experts"][0].reset_parameters()
    declare_replicas(model, experts="experts.*", mesh=mesh)
    if plant and rank == 3:
        with torch.no_grad():
            model["experts"][0].bias[0] += 1.0
    return audit(model).to_dict()


def _bad(rec: dict[str, Any]) -> list[tuple[str, list[int], list[int]]]:
    return [(m["name"], m["ranks"], m["reference_ranks"]) for m in rec["mismatches"]]


def test_pipeline_stages_compared_within_their_dp_group_in_a_world_wide_audit() -> None:
    clean = run_ranks(_stage_audit, 4, "group", False)
    assert all(r["in_sync"] and not r["mismatches"] for r in clean), [_bad(r) for r in clean]
    assert clean[0]["checked"]["param"] == 4  # two stages' weight and bias, each compared within its group
    planted = run_ranks(_stage_audit, 4, "group", True)
    assert _bad(planted[0]) == [("stage1.0.weight", [3], [1])], _bad(planted[0])
    assert all(r["mismatches"] == planted[0]["mismatches"] for r in planted)


def test_pipeline_stage_from_a_device_mesh_with_a_pp_dim() -> None:
    planted = run_ranks(_stage_audit, 4, "mesh", True)
    assert _bad(planted[0]) == [("stage1.0.weight", [3], [1])], _bad(planted[0])


def test_experts_compared_only_among_the_ranks_holding_them() -> None:
    clean = run_ranks(_expert_audit, 4, False)
    assert all(r["in_sync"] for r in clean), [_bad(r) for r in clean]
    planted = run_ranks(_expert_audit, 4, True)
    assert _bad(planted[0]) == [("experts.0.bias", [3], [1])], _bad(planted[0])
    assert planted[0]["mismatches"][0]["shard"] == {"experts": 1}
