"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU gloo ranks: replicas compared, partitions named as unreplicated.

DeepSpeed installs from its source distribution (``DS_BUILD_OPS=0 pip install deepspeed``, the
``[deepspeed]`` extra); without it these tests skip. Its shared-memory op compiles once on first use
(about a minute, cached), so they are marked slow. A torch optimizer is passed in, not DeepSpeed's
FusedAdam, which would compile another op.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.ranks import free_port, run_ranks

deepspeed = pytest.importorskip("deepspeed")  # imported here, before the ranks fork: they inherit it

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _engine(rank: int, world: int, port: int, stage: int) -> Any:
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    model.register_buffer("scale", torch.ones(4))
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 20  # the two weights are partitioned, the rest persist
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero, "zero_allow_untested_optimizer": True}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
    return engine


def _zero2(rank: int, world: int, port: int) -> dict[str, Any]:
    from weightsync_audit import audit

    engine = _engine(rank, world, port, 2)
    out = {"clean": audit(engine.module, engine.optimizer).to_dict(), "engine": audit(engine).to_dict()}
    zopt = engine.optimizer
    plants = {
        "param": next(engine.module.parameters()).data.view(-1),
        "master": zopt.single_partition_of_fp32_groups[0].data.view(-1),
        "exp_avg": next(iter(zopt.optimizer.state.values()))["exp_avg"].view(-1),
    }
    for what, t in plants.items():
        saved = t[:1].clone()
        if rank == 1:
            t[:1].add_(1.0)
        out[what] = audit(engine.module, engine.optimizer).to_dict()
        t[:1].copy_(saved)
    return out


def _zero3(rank: int, world: int, port: int) -> dict[str, Any]:
    from weightsync_audit import audit

    engine = _engine(rank, world, port, 3)
    module = engine.module
    out = {"clean": audit(module, engine.optimizer).to_dict()}
    params = dict(module.named_parameters())
    for what, t in (("partition", params["0.weight"].ds_tensor), ("persistent", params["0.bias"].data)):
        saved = t.data.view(-1)[:1].clone()
        if rank == 1:
            t.data.view(-1)[:1].add_(1.0)
        out[what] = audit(module, engine.optimizer).to_dict()
        t.data.view(-1)[:1].copy_(saved)
    return out


def _bad(rec: dict[str, Any]) -> list[tuple[str, list[int]]]:
    return [(m["name"], m["ranks"]) for m in rec["mismatches"]]


def test_zero2_compares_params_buffers_and_the_optimizers_replicated_part_never_its_partitions() -> None:
    r0, r1 = run_ranks(_zero2, 2, free_port(), timeout=600)
    clean = r0["clean"]
    assert clean["in_sync"] and clean["checked"]["param"] == 6 and clean["checked"]["buffer"] == 1, clean
    note = " ".join(clean["notes"])
    assert "2 tensors have no replica to compare (2 ZeRO optimizer partitions)" in note, note  # exp_avg, exp_avg_sq
    assert r0["engine"]["checked"]["param"] == 6  # the DeepSpeedEngine itself is peeled to the user's model
    assert not r0["param"]["in_sync"] and _bad(r0["param"]) == [("0.weight", [1])]
    assert r0["exp_avg"]["in_sync"]  # a partition has one owner: nothing to compare it with
    # The local check: rank 1's module params are no longer the cast of its own fp32 master partition.
    assert _bad(r0["master"]) == [("zero.fp32_master_matches_params", [1])], r0["master"]
    for k in r0:
        assert r0[k]["mismatches"] == r1[k]["mismatches"] and r0[k].get("notes") == r1[k].get("notes")


def test_zero3_never_counts_a_placeholder_and_compares_persistent_params() -> None:
    r0, r1 = run_ranks(_zero3, 2, free_port(), timeout=600)
    clean = r0["clean"]
    assert clean["in_sync"] and clean["checked"]["param"] == 4, clean  # 0.weight, 2.weight are placeholders
    assert "2 ZeRO-3 partitioned parameters" in " ".join(clean["notes"]), clean["notes"]
    assert r0["partition"]["in_sync"] and "2 ZeRO-3 partitioned parameters" in " ".join(r0["partition"]["notes"])
    assert _bad(r0["persistent"]) == [("0.bias", [1])]
    for k in r0:
        assert r0[k]["mismatches"] == r1[k]["mismatches"] and r0[k].get("notes") == r1[k].get("notes")
