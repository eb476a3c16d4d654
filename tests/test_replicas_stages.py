"""Pipeline stages and expert groups, named once with ``declare_replicas``: a world-wide audit with no
``group=`` compares each stage within its data-parallel group and each expert within its holders; a stage's
differing value is named with its group and rank, and its gap measured between its holders."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ranks import run_ranks


def _train_stage(rank: int, how: str, dp: list[Any], pp: list[Any]) -> tuple[torch.nn.Module, Any, Any]:
    """One step of a (dp=2, pp=2) grid: stage 0 on ranks 0 and 2, stage 1 on ranks 1 and 3. ``pipelining``:
    a real ``torch.distributed.pipelining`` GPipe step within each pipeline (ranks 0-1, 2-3), the gradients
    then averaged within each stage's data-parallel group; otherwise each stage steps on its own batch."""
    import torch.distributed as dist

    stage = rank % 2
    torch.manual_seed(stage)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16)) if stage == 0 else torch.nn.Sequential(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    if how != "pipelining":
        module(torch.randn(2, module[0].in_features)).sum().backward()
        opt.step()
        return module, opt, None
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pipe = PipelineStage(module, stage, 2, torch.device("cpu"), group=pp[rank // 2])
    schedule = ScheduleGPipe(pipe, n_microbatches=2, loss_fn=lambda out, y: (out - y).pow(2).mean())
    g = torch.Generator().manual_seed(10 + rank // 2)  # each pipeline its own batch
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    if stage == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)
    for p in module.parameters():
        dist.all_reduce(p.grad, group=dp[stage])
        p.grad /= 2
    opt.step()
    return module, opt, pipe


def _stages(rank: int, world: int) -> dict[str, Any]:
    """One launch, three ways to name the stages; each audited healthy, then with rank 3's (stage 1) weight
    moved by 0.5."""
    import torch.distributed as dist

    from weightsync_audit import audit, declare_replicas

    dp = [dist.new_group([s, s + 2]) for s in range(2)]  # every rank creates every group, in order
    pp = [dist.new_group([2 * d, 2 * d + 1]) for d in range(2)]
    out: dict[str, Any] = {}
    for how in ("group", "pipelining", "mesh"):
        module, opt, pipe = _train_stage(rank, how, dp, pp)
        if how == "mesh":
            from torch.distributed.device_mesh import init_device_mesh

            declare_replicas(module, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")))
        else:  # the stage's index, or the pipelining stage object itself
            declare_replicas(module, stage=pipe if pipe is not None else rank % 2, stage_group=dp[rank % 2])
        out[f"{how}.clean"] = audit(module, opt).to_dict()
        with torch.no_grad():
            if rank == 3:
                module[0].weight[0, 0] += 0.5
            out[f"{how}.plant"] = audit(module, opt).to_dict()
            if rank == 3:
                module[0].weight[0, 0] -= 0.5
    return out


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


@pytest.fixture(scope="module")
def stages() -> list[dict[str, Any]]:
    return run_ranks(_stages, 4)


@pytest.mark.parametrize("how", ["group", "pipelining", "mesh"])
def test_pipeline_stages_compared_within_their_dp_group_in_a_world_wide_audit(
    stages: list[dict[str, Any]], how: str
) -> None:
    clean = [r[f"{how}.clean"] for r in stages]
    assert all(r["in_sync"] and not r["mismatches"] for r in clean), [_bad(r) for r in clean]
    assert clean[0]["checked"]["param"] == 4  # two stages' weight and bias, each compared within its group
    planted = [r[f"{how}.plant"] for r in stages]
    assert _bad(planted[0]) == [("stage1.0.weight", [3], [1])], _bad(planted[0])
    assert all(r["mismatches"] == planted[0]["mismatches"] for r in planted)


@pytest.mark.parametrize("how", ["group", "pipelining", "mesh"])
def test_pipeline_stage_value_change_names_its_group_and_measures_its_gap(
    stages: list[dict[str, Any]], how: str
) -> None:
    bad = stages[0][f"{how}.plant"]["mismatches"][0]
    assert bad["kind"] == "param" and bad["shape"] == [4, 16], bad  # a value, not a structure difference
    assert bad["detail"].startswith("value differs among the ranks holding it, ranks [1, 3]"), bad["detail"]
    # Measured between the holders: rank 1 sent its copy to rank 3; ranks 0 and 2 hold no stage 1.
    assert bad["max_abs_diff"] == 0.5 and bad["diff_count"] == 1, bad


def test_experts_compared_only_among_the_ranks_holding_them() -> None:
    clean = run_ranks(_expert_audit, 4, False)
    assert all(r["in_sync"] for r in clean), [_bad(r) for r in clean]
    planted = run_ranks(_expert_audit, 4, True)
    assert _bad(planted[0]) == [("experts.0.bias", [3], [1])], _bad(planted[0])
    assert planted[0]["mismatches"][0]["shard"] == {"experts": 1}
