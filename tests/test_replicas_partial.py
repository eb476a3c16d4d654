"""Tensors held by some ranks only (pipeline stages, experts), judged as strictly as DDP replicas.

Every case computes its truth without the tool: each rank's tensors (trainable flag, shape, dtype, bytes)
are gathered with ``all_gather_object`` and compared by the test, within the group the test itself built.
The audit must then name exactly the tensors and ranks the truth names: a rank of the declared group that
lacks a tensor, or holds it frozen, is a structure mismatch; a tensor no other rank holds is never counted
in ``checked``, and an audit that compared nothing says so.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.ranks import run_ranks

Sig = tuple[bool, tuple[int, ...], str, bytes]


def _held(module: torch.nn.Module, prefix: str = "") -> dict[str, Sig]:
    """What this rank holds, by the name the test gives it: trainable flag, shape, dtype, bytes."""
    out: dict[str, Sig] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        flag = bool(t.requires_grad)
        out[prefix + name] = (flag, tuple(t.shape), str(t.dtype), t.detach().contiguous().numpy().tobytes())
    return out


def truth(held: dict[str, Sig], group: list[int]) -> list[tuple[str, list[int]]]:
    """The tensors whose holders in ``group`` (global ranks, this rank's replica group) disagree, each
    with the members that differ from the lowest member holding it (two replicas: the tie's reference);
    a member lacking the tensor differs. Computed by gathering every rank's tensors: no tool involved."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, held)
    out = []
    for name in sorted({n for r in group for n in every[r]}):
        holders = [r for r in group if name in every[r]]
        ref = every[holders[0]][name]
        odd = [r for r in group if every[r].get(name) != ref]
        if odd and len(group) > 1:
            out.append((name, odd))
    return out


def _found(rec: dict[str, Any]) -> list[tuple[str, list[int]]]:
    return sorted((m["name"], m["ranks"]) for m in rec["mismatches"])


def _stage(rank: int, world: int, case: str) -> dict[str, Any]:
    """2 stages x 2 replicas (stage 0 on ranks 0, 2; stage 1 on ranks 1, 3), or with ``span`` one stage on
    every rank; ``case`` plants a difference on rank 3."""
    import torch.distributed as dist

    from weightsync_audit import audit, declare_replicas

    dp = [dist.new_group([s, s + 2]) for s in range(2)]
    stage = 0 if case.startswith("span") else rank % 2
    group = list(range(world)) if case.startswith("span") else [stage, stage + 2]
    torch.manual_seed(stage)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    if case.endswith("frozen") and rank == 3:
        module[0].weight.requires_grad_(False)
    if case.endswith("no-buffer") and rank == 3:
        del module[1]._buffers["running_var"]
    if case.endswith("value") and rank == 3:
        with torch.no_grad():
            module[0].bias[1] += 0.25
    declare_replicas(module, stage=stage, stage_group=dist.group.WORLD if case.startswith("span") else dp[stage])
    rec = audit(module).to_dict()
    return {"rec": rec, "truth": truth(_held(module, f"stage{stage}."), group)}


def _check(out: list[dict[str, Any]]) -> None:
    """The audit names what the truth names, the same on every rank; the whole world's truth."""
    want = sorted({t for o in out for t in map(lambda x: (x[0], tuple(x[1])), o["truth"])})
    got = _found(out[0]["rec"])
    assert [(n, tuple(r)) for n, r in got] == want, (got, want)
    assert out[0]["rec"]["in_sync"] == (not want)
    assert all(o["rec"]["mismatches"] == out[0]["rec"]["mismatches"] for o in out)


def test_stage_replica_frozen_on_one_rank_is_a_structure_mismatch() -> None:
    out = run_ranks(_stage, 4, "frozen")
    _check(out)
    assert out[0]["truth"] == [] and out[1]["truth"] == [("stage1.0.weight", [3])]  # the truth found it
    bad = out[0]["rec"]["mismatches"][0]
    assert bad["kind"] == "structure" and "frozen (requires_grad=False) on rank 3" in bad["detail"], bad


def test_stage_buffer_missing_on_one_replica_is_a_structure_mismatch() -> None:
    out = run_ranks(_stage, 4, "no-buffer")
    _check(out)
    assert out[1]["truth"] == [("stage1.1.running_var", [3])]
    bad = out[0]["rec"]["mismatches"][0]
    assert bad["kind"] == "structure" and "missing on rank 3" in bad["detail"], bad


def test_stage_value_still_found_and_a_clean_grid_still_in_sync() -> None:
    _check(run_ranks(_stage, 4, "value"))
    clean = run_ranks(_stage, 4, "clean")
    _check(clean)
    assert clean[0]["rec"]["checked"]["param"] == 8 and clean[0]["rec"]["checked"]["buffer"] == 6


def test_one_stage_on_every_rank_finds_the_frozen_flag_too() -> None:
    _check(run_ranks(_stage, 4, "span-frozen"))


def _expert_model(rank: int, case: str) -> tuple[torch.nn.ModuleDict, Any]:
    """Expert groups {0, 2} (expert 0) and {1, 3} (expert 1): the dense layer alike on every rank, each rank
    its group's expert; ``missing``: rank 3 holds no expert 1. Returns the model and this rank's expert group."""
    import torch.distributed as dist

    ep = [dist.new_group([c, c + 2]) for c in range(2)]
    coord = rank % 2
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"dense": torch.nn.Linear(4, 4), "experts": torch.nn.ModuleDict()})
    torch.manual_seed(100 + coord)
    if not (case == "missing" and rank == 3):
        model["experts"][str(coord)] = torch.nn.Linear(4, 4)
    return model, ep[coord]


def _experts(rank: int, world: int, case: str) -> dict[str, Any]:
    """The expert model audited; ``frozen``: rank 3's expert 1 bias frozen."""
    from weightsync_audit import audit, declare_replicas

    coord = rank % 2
    model, group = _expert_model(rank, case)
    if case == "frozen" and rank == 3:
        model["experts"]["1"].bias.requires_grad_(False)
    declare_replicas(model, experts="experts.*", expert_group=group)
    rec = audit(model).to_dict()
    held = _held(model)
    experts = {n: s for n, s in held.items() if n.startswith("experts.")}
    dense = {n: s for n, s in held.items() if not n.startswith("experts.")}
    return {"rec": rec, "truth": truth(experts, [coord, coord + 2]) + truth(dense, list(range(world)))}


def test_expert_missing_on_one_rank_of_its_group_is_a_structure_mismatch() -> None:
    out = run_ranks(_experts, 4, "missing")
    _check(out)
    assert out[1]["truth"] == [("experts.1.bias", [3]), ("experts.1.weight", [3])]
    assert all("missing on rank 3" in m["detail"] for m in out[0]["rec"]["mismatches"])


def test_expert_frozen_on_one_rank_and_clean_experts() -> None:
    _check(run_ranks(_experts, 4, "frozen"))
    clean = run_ranks(_experts, 4, "clean")
    _check(clean)
    assert clean[0]["rec"]["checked"]["param"] == 6  # dense weight and bias, two experts' weight and bias


def _alone(rank: int, world: int, plant: bool) -> dict[str, Any]:
    """One stage per rank: no tensor has a replica."""
    import torch.distributed as dist

    from weightsync_audit import audit, declare_replicas

    own = [dist.new_group([r]) for r in range(world)]
    torch.manual_seed(rank)
    module = torch.nn.Linear(4, 4)
    declare_replicas(module, stage=rank, stage_group=own[rank])
    result = audit(module)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, sorted(_held(module, f"stage{rank}.")))
    shared = [n for n in every[rank] if sum(n in names for names in every) > 1]
    return {"rec": result.to_dict(), "text": result.summary(), "shared": shared}


def test_one_stage_per_rank_compares_nothing_and_says_so() -> None:
    out = run_ranks(_alone, 2, False)
    assert out[0]["shared"] == [] and out[1]["shared"] == []  # the truth: nothing has a replica
    rec = out[0]["rec"]
    assert rec["checked"]["param"] == 0 and sum(rec["checked"].values()) == 0, rec["checked"]
    assert any(n.startswith("nothing was compared: no tensor has a replica") for n in rec.get("notes", [])), rec
    assert "nothing was compared: no tensor has a replica" in out[0]["text"], out[0]["text"]
    assert all(o["rec"]["notes"] == rec["notes"] and o["rec"]["checked"] == rec["checked"] for o in out)


def _declared_after_caching(rank: int, world: int) -> list[dict[str, Any]]:
    """One stage per rank, declared only after an ``Auditor`` has cached the undeclared model's manifest."""
    import torch.distributed as dist

    from weightsync_audit import Auditor, declare_replicas

    own = [dist.new_group([r]) for r in range(world)]
    torch.manual_seed(rank)
    module = torch.nn.Linear(4, 4)
    auditor = Auditor(module)
    records = [auditor.audit().to_dict(), auditor.audit().to_dict()]  # the second reads the cached manifest
    declare_replicas(module, stage=rank, stage_group=own[rank])
    return [*records, auditor.audit().to_dict()]


def test_a_declaration_made_after_an_auditor_cached_the_manifest_is_read_by_its_next_audit() -> None:
    out = run_ranks(_declared_after_caching, 2)
    for records in out:
        before, cached, declared = records
        assert before["in_sync"] is False and cached["in_sync"] is False  # undeclared: two different replicas
        assert declared["in_sync"] is True and sum(declared["checked"].values()) == 0, declared
        assert any(n.startswith("nothing was compared: no tensor has a replica") for n in declared["notes"])


def _stage_bytes(module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, bytes]:
    out = {n: s[3] for n, s in _held(module).items()}
    for i, p in enumerate(module.parameters()):
        for k, v in opt.state[p].items():
            out[f"state.{i}.{k}"] = v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode()
    return out


def _loop_resync(rank: int, world: int, src: Any) -> dict[str, Any]:
    """2 stages x 2 replicas under ``LoopAudit(on_mismatch="resync")``; rank 3 (stage 1) and rank 0
    (stage 0) each drift one weight after a step. The truth: every rank's bytes gathered by the test."""
    import torch.distributed as dist

    from weightsync_audit import LoopAudit, declare_replicas

    dp = [dist.new_group([s, s + 2]) for s in range(2)]
    stage = rank % 2
    torch.manual_seed(stage)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    declare_replicas(module, stage=stage, stage_group=dp[stage])
    module(torch.randn(3, 4, generator=torch.Generator().manual_seed(stage))).sum().backward()
    opt.step()
    with torch.no_grad():
        if rank == 3:
            module[0].weight[1, 2] += 0.5
        if rank == 0:
            module[0].bias[0] -= 0.25
    before = _stage_bytes(module, opt)
    with LoopAudit(module, opt, every_n_steps=1, on_mismatch="resync", resync_src=src, verbose=False) as loop:
        rec = loop.step(1).to_dict()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, [before, _stage_bytes(module, opt)])
    return {"rec": rec, "every": every}


def test_loop_audit_resync_on_pipeline_stages_copies_within_each_stage_group_only() -> None:
    for src in (0, "majority"):
        out = run_ranks(_loop_resync, 4, src)
        rec, every = out[0]["rec"], out[0]["every"]
        assert all((o["rec"]["action"], o["rec"]["mismatches"]) == (rec["action"], rec["mismatches"]) for o in out)
        assert rec["action"] == "resynced", rec
        # Stage 0 ties (the reference: the lowest rank, 0); stage 1's reference is rank 1.
        assert sorted((m["name"], m["ranks"]) for m in rec["mismatches"]) == [
            ("stage0.0.bias", [2]),
            ("stage1.0.weight", [3]),
        ], rec
        for s in range(2):  # the truth: each stage group bit-identical afterwards, to the right source
            a, b = every[s][1], every[s + 2][1]
            assert a == b, (src, s, [k for k in a if a[k] != b.get(k)])
        assert every[1][1] == every[1][0]  # stage 1 copied from rank 1, which held the value before
        assert every[0][1] == every[0][0] and every[2][1] != every[2][0]  # stage 0 from rank 0 (the tie)
        assert every[0][1] != every[1][1]  # no copy across stages


def _expert_resync(rank: int, world: int, case: str) -> dict[str, Any]:
    """A world-wide ``resync(src=0)`` of an expert model: expert 1 (ranks 1, 3) drifted on rank 3, the dense
    layer on rank 2; ``missing``: rank 3 holds no expert 1 (refused on every rank, nothing moved)."""
    import torch.distributed as dist

    from weightsync_audit import declare_replicas, resync

    model, group = _expert_model(rank, case)
    with torch.no_grad():
        if rank == 3 and case != "missing":
            model["experts"]["1"].weight[0, 0] += 1.0
        if rank == 2:
            model["dense"].bias[0] += 1.0
    declare_replicas(model, experts="experts.*", expert_group=group)
    before = _held(model)
    error = None
    try:
        resync(model, src=0)
    except ValueError as exc:
        error = str(exc)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, [before, _held(model)])
    return {"every": every, "error": error}


def test_world_wide_resync_of_experts_copies_each_expert_within_its_group() -> None:
    out = run_ranks(_expert_resync, 4, "drift")
    every = out[0]["every"]
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    for r in range(4):  # the dense layer from rank 0 everywhere
        assert every[r][1]["dense.bias"] == every[0][0]["dense.bias"]
    assert every[3][1]["experts.1.weight"] == every[1][0]["experts.1.weight"]  # from rank 1, its group's
    assert every[2][1]["experts.0.weight"] == every[0][0]["experts.0.weight"]
    assert every[1][1] == {**every[1][0], "dense.bias": every[0][0]["dense.bias"]}  # nothing else moved


def test_resync_refuses_an_expert_missing_in_its_group_on_every_rank_before_moving() -> None:
    out = run_ranks(_expert_resync, 4, "missing")
    assert all(o["error"] and "experts.1.weight" in o["error"] for o in out), [o["error"] for o in out]
    assert all(b == a for b, a in out[0]["every"]), "nothing moved"


def _titan(rank: int, world: int, how: str) -> dict[str, Any]:
    """torchtitan's way: each stage keeps the model's own (global) names, the layers of other stages
    deleted; a real GPipe step of 2 pipelines (ranks 0-1, 2-3), stage = rank % 2, then each stage's
    gradients averaged in its data-parallel group. The audit is handed the ``PipelineStage`` or the
    schedule itself, with no declaration; then rank 3 (stage 1) drifts."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from weightsync_audit import audit

    dp = [dist.new_group([s, s + 2]) for s in range(2)]
    pp = [dist.new_group([2 * d, 2 * d + 1]) for d in range(2)]
    stage = rank % 2
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(8, 8), "1": torch.nn.Linear(8, 4)})
    del model.layers[str(1 - stage)]  # this stage keeps its own layer, under its global name

    class Part(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.layers = inner.layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[str(stage)](x)

    part = Part(model)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    pipe = PipelineStage(part, stage, 2, torch.device("cpu"), group=pp[rank // 2])
    schedule = ScheduleGPipe(pipe, n_microbatches=2, loss_fn=lambda out, y: (out - y).pow(2).mean())
    g = torch.Generator().manual_seed(10 + rank // 2)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    schedule.step(x) if stage == 0 else schedule.step(target=y)
    for p in part.parameters():
        dist.all_reduce(p.grad, group=dp[stage])
        p.grad /= 2
    opt.step()
    handed = schedule if how == "schedule" else pipe
    out: dict[str, Any] = {"clean": audit(handed, opt).to_dict()}
    out["clean_truth"] = truth(_held(part), [stage, stage + 2])
    with torch.no_grad():
        if rank == 3 and how == "missing":
            part.layers["1"].register_parameter("bias", None)  # one replica of stage 1 lacks it
        elif rank == 3:
            part.layers["1"].weight[0, 1] += 0.5
    out["plant"] = audit(handed, opt).to_dict()
    out["plant_truth"] = truth(_held(part), [stage, stage + 2])
    return out


def test_pipelining_stage_or_schedule_with_global_names_audited_world_wide_without_declaration() -> None:
    for how in ("stage", "schedule"):
        out = run_ranks(_titan, 4, how)
        assert all(o["clean_truth"] == [] for o in out)
        clean = out[0]["clean"]
        assert clean["in_sync"] and not clean["mismatches"], (how, clean["mismatches"])
        assert clean["checked"]["param"] == 4, clean["checked"]  # each stage's weight and bias, in its group
        assert out[1]["plant_truth"] == [("layers.1.weight", [3])]
        _check([{"rec": o["plant"], "truth": o["plant_truth"]} for o in out])
        bad = out[0]["plant"]["mismatches"][0]
        assert (bad["kind"], bad["ranks"], bad["reference_ranks"]) == ("param", [3], [1]), bad


def _pp_mesh(rank: int, world: int, how: str) -> dict[str, Any]:
    """A ``(pp, dp)`` mesh (stage 0 on ranks 0, 1; stage 1 on ranks 2, 3), each stage's layer under its
    global name as DTensors on the stage's ``dp`` submesh: ``fsdp`` (fully_shard: every piece has one owner)
    or ``replicate`` (Replicate placements: a replica on each rank of the stage); rank 3 then drifts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    from weightsync_audit import audit

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(8, 8), "1": torch.nn.Linear(8, 4)})
    del model.layers[str(1 - stage)]
    if how == "fsdp":
        fully_shard(model, mesh=mesh["dp"])
    else:
        layer = model.layers[str(stage)]
        for name, p in list(layer.named_parameters()):
            dt = distribute_tensor(p.detach(), mesh["dp"], [Replicate()])
            setattr(layer, name, torch.nn.Parameter(dt))
    held = {n: (bool(p.requires_grad), tuple(p.shape), str(p.dtype), p.detach().full_tensor().numpy().tobytes())
            for n, p in model.named_parameters()}  # fmt: skip
    out: dict[str, Any] = {"clean": audit(model).to_dict(), "clean_truth": truth(held, [2 * stage, 2 * stage + 1])}
    if how == "replicate":
        with torch.no_grad():
            if rank == 3:
                model.layers["1"].bias.to_local()[0] += 1.0
        held = {
            n: (True, tuple(p.shape), str(p.dtype), p.detach().to_local().numpy().tobytes())
            for n, p in model.named_parameters()
        }
        out["plant"] = audit(model).to_dict()
        out["plant_truth"] = truth(held, [2 * stage, 2 * stage + 1])
    return out


def test_dtensors_on_a_stage_submesh_of_a_pp_mesh_no_false_alarm_and_difference_named_in_its_group() -> None:
    shards = run_ranks(_pp_mesh, 4, "fsdp")
    rec = shards[0]["clean"]
    assert all(o["clean_truth"] == [] for o in shards)
    assert rec["in_sync"] and not rec["mismatches"], rec["mismatches"]
    assert rec["checked"]["param"] == 0 and rec["notes"][0].startswith("nothing was compared"), rec
    reps = run_ranks(_pp_mesh, 4, "replicate")
    assert reps[0]["clean"]["in_sync"] and reps[0]["clean"]["checked"]["param"] == 4, reps[0]["clean"]
    assert reps[3]["plant_truth"] == [("layers.1.bias", [3])]
    _check([{"rec": o["plant"], "truth": o["plant_truth"]} for o in reps])
    bad = reps[0]["plant"]["mismatches"][0]
    assert (bad["kind"], bad["ranks"], bad["reference_ranks"]) == ("param", [3], [2]), bad


def test_undeclared_pipeline_stage_a_replica_lacking_a_tensor_is_a_structure_mismatch() -> None:
    out = run_ranks(_titan, 4, "missing")
    assert out[1]["plant_truth"] == [("layers.1.bias", [3])]
    _check([{"rec": o["plant"], "truth": o["plant_truth"]} for o in out])
    bad = out[0]["plant"]["mismatches"][0]
    assert bad["kind"] == "structure" and "missing on rank 3" in bad["detail"], bad
