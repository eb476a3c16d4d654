"""The framework-free fix: ``rewrap_ddp`` / ``maybe_rewrap`` on real gloo ranks, no Lightning."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # DDP imports it lazily at construction: once here, not in every forked rank
import torch.distributed as dist
from ranks import RankFailed, run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from weightsync_audit import audit, maybe_rewrap, rewrap_ddp
from weightsync_audit.compat import ddp_comm_hooks
from weightsync_audit.ddp.inspect import ddp_settings
from weightsync_audit.engine.explain.evidence import synced_parameter_names

GLOBAL_BATCH = 8
LR = 0.1


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def global_batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(GLOBAL_BATCH, 6, generator=g) for _ in range(steps)]


def loss_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (net(x) - 1.0).pow(2).mean()


def single_process(steps: int, switch_at: int, *, frozen_first: bool = True) -> dict[str, torch.Tensor]:
    """The reference: one process, the whole global batch, the same schedule: layer 0 frozen until ``switch_at``
    (``frozen_first``), or trainable until then and frozen from it."""
    model = make_model()
    model[0].requires_grad_(not frozen_first)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i, x in enumerate(global_batches(steps)):
        if i == switch_at:
            model[0].requires_grad_(frozen_first)
        opt.zero_grad(set_to_none=True)
        loss_of(model, x).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _train_through_unfreeze(rank: int, world: int, fix: str, steps: int = 6, unfreeze_at: int = 3) -> dict:
    model = make_model()
    model[0].requires_grad_(False)  # frozen when DDP wraps: its reducer leaves layer 0 out
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # all params: SGD skips those without grad
    per_rank = GLOBAL_BATCH // world
    wrappers = []
    for i, x in enumerate(global_batches(steps)):
        if i == unfreeze_at:
            model[0].requires_grad_(True)
            if fix == "before_forward":
                ddp = maybe_rewrap(ddp)
        mine = x[rank * per_rank : (rank + 1) * per_rank]
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, mine).backward()
        if fix == "after_backward":
            # The change is noticed only after a backward under the stale reducer: average by hand.
            ddp = maybe_rewrap(ddp, reduce_pending=True)
        opt.step()
        wrappers.append(id(ddp))
    result = audit(ddp, step=steps)
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "in_sync": result.in_sync,
        "diverged": result.diverged_names,
        "wrappers": len(set(wrappers)),
        "synced": sorted(synced_parameter_names(ddp)),
    }


def test_unfreezing_without_a_rewrap_leaves_the_unfrozen_layer_unsynced() -> None:
    out = run_ranks(_train_through_unfreeze, 2, "none")
    assert not out[0]["in_sync"]
    assert sorted(out[0]["diverged"]) == ["0.bias", "0.weight"]
    assert out[0]["synced"] == ["2.bias", "2.weight"]


@pytest.mark.parametrize("fix", ["before_forward", "after_backward"])
def test_maybe_rewrap_after_unfreezing_all_reduces_like_one_process_on_the_global_batch(fix: str) -> None:
    steps, unfreeze_at = 6, 3
    out = run_ranks(_train_through_unfreeze, 2, fix, steps, unfreeze_at)
    reference = single_process(steps, unfreeze_at)
    for r in out:
        assert r["in_sync"], r["diverged"]
        assert r["wrappers"] == 2  # one re-wrap, at the unfreeze, none on the steps that changed nothing
        assert r["synced"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for k, v in out[0]["state"].items():
        assert torch.equal(v, out[1]["state"][k]), f"{k} differs between ranks"
        # An all-reduce of the mean gradient, not a copy of one rank's weights: the single-process result.
        assert torch.allclose(v, reference[k], atol=1e-6, rtol=0), (k, (v - reference[k]).abs().max())
    assert not torch.equal(out[0]["state"]["0.weight"], make_model().state_dict()["0.weight"])


class CountingState:
    def __init__(self) -> None:
        self.calls = 0


# ``bucket`` is unannotated on purpose: DDP checks the annotation is dist.GradBucket, and
# ``from __future__ import annotations`` would turn it into a string.
def counting_allreduce(state: CountingState, bucket):  # type: ignore[no-untyped-def]
    state.calls += 1
    return default_hooks.allreduce_hook(None, bucket)


def _settings_after_rewrap(rank: int, world: int) -> dict:
    model = make_model()
    model[0].requires_grad_(False)
    state = CountingState()
    ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=True, bucket_cap_mb=2)
    ddp.register_comm_hook(state, counting_allreduce)
    static = DDP(make_model(), static_graph=True, broadcast_buffers=False)
    model[0].requires_grad_(True)
    new = rewrap_ddp(ddp)
    new_static = rewrap_ddp(static)
    # Train one step through the re-wrapped comm hook to show it is live.
    loss_of(new, torch.randn(4, 6) + rank).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    gathered = [torch.zeros_like(grads[0]) for _ in range(world)]
    dist.all_gather(gathered, grads[0])
    keep = ("find_unused_parameters", "gradient_as_bucket_view", "static_graph", "bucket_cap_mb", "broadcast_buffers")
    return {
        "old": {k: ddp_settings(ddp).get(k) for k in keep},
        "new": {k: ddp_settings(new).get(k) for k in keep},
        "old_static": {k: ddp_settings(static).get(k) for k in keep},
        "new_static": {k: ddp_settings(new_static).get(k) for k in keep},
        "hooks_same": ddp_comm_hooks(new) == [(counting_allreduce, state)],
        "hook_calls": state.calls,
        "same_process_group": new.process_group is ddp.process_group,
        "layer0_grad_agrees": torch.equal(gathered[0], gathered[1]),
    }


def test_rewrap_ddp_keeps_the_wrappers_settings_and_comm_hooks() -> None:
    r = run_ranks(_settings_after_rewrap, 2)[0]
    assert r["old"] == r["new"]
    assert r["new"]["find_unused_parameters"] and r["new"]["gradient_as_bucket_view"]
    assert r["new"]["bucket_cap_mb"] == pytest.approx(2.0)
    assert r["old_static"] == r["new_static"]
    assert r["new_static"]["static_graph"] and r["new_static"]["broadcast_buffers"] is False
    assert r["hooks_same"] and r["hook_calls"] >= 1 and r["same_process_group"]
    assert r["layer0_grad_agrees"]


def _no_change_is_free(rank: int, world: int) -> dict:
    model = make_model()
    ddp = DDP(model)
    first = maybe_rewrap(ddp)  # reads the reducer once, remembers the flags
    again = [maybe_rewrap(first) is first for _ in range(100)]
    return {"same": first is ddp and all(again)}


def test_maybe_rewrap_returns_the_same_wrapper_while_the_trainable_set_is_unchanged() -> None:
    assert all(r["same"] for r in run_ranks(_no_change_is_free, 2))


def _freeze_mid_training(rank: int, world: int, fix: str, bucket_view: bool = False) -> dict:
    model = make_model()
    # find_unused_parameters=False: a frozen parameter stalls its bucket. 1 KiB buckets: one per layer.
    ddp = DDP(model, bucket_cap_mb=1 / 1024, gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per_rank = GLOBAL_BATCH // world
    for i, x in enumerate(global_batches(6)):
        if i == 2:
            model[0].requires_grad_(False)
            if fix == "before_forward":
                ddp = maybe_rewrap(ddp)
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, x[rank * per_rank : (rank + 1) * per_rank]).backward()
        if fix == "after_backward":
            ddp = maybe_rewrap(ddp, reduce_pending=True)
        opt.step()
    return {"in_sync": audit(ddp).in_sync, "state": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("fix", ["before_forward", "after_backward"])
def test_freezing_mid_training_with_maybe_rewrap_trains_on_like_one_process(fix: str) -> None:
    out = run_ranks(_freeze_mid_training, 2, fix)
    reference = single_process(6, 2, frozen_first=False)
    assert all(r["in_sync"] for r in out)
    for k, v in out[0]["state"].items():
        assert torch.allclose(v, reference[k], atol=1e-6, rtol=0), (k, (v - reference[k]).abs().max())


def test_freezing_after_the_forward_with_gradient_as_bucket_view_still_keeps_replicas_in_sync() -> None:
    # The one case the hand average cannot make exact (see reduce_grads_by_hand): in sync, and trains on.
    out = run_ranks(_freeze_mid_training, 2, "after_backward", True)
    assert all(r["in_sync"] for r in out)


def test_freezing_mid_training_without_a_rewrap_breaks_ddps_reduction() -> None:
    out = run_ranks(_freeze_mid_training, 2, "none", expect_errors=True)
    assert all(isinstance(r, RankFailed) for r in out)
    assert "finished reduction in the prior iteration" in out[0].message


def _unfreeze_on_rank_1_only(rank: int, world: int, where: str) -> dict:
    import time

    from weightsync_audit import TrainableSetMismatchError

    model = make_model()
    model[0].requires_grad_(False)
    ddp = DDP(model)
    if rank == 1:
        model[0].requires_grad_(True)  # a rank-local decision: the others keep it frozen
    t0 = time.monotonic()
    try:
        maybe_rewrap(ddp, timeout_s=20)
    except TrainableSetMismatchError as exc:
        return {"error": str(exc), "ranks": exc.ranks, "seconds": time.monotonic() - t0}
    return {"error": None}


def test_ranks_that_disagree_on_the_trainable_set_all_raise_the_library_error_naming_them() -> None:
    out = run_ranks(_unfreeze_on_rank_1_only, 2, "maybe_rewrap", timeout=60)
    for r in out:
        assert r["error"] is not None, "a rank went on into DDP's constructor alone"
        assert "0.weight" in r["error"] and "rank 1" in r["error"], r["error"]
        assert r["seconds"] < 10
    assert out[0]["error"] == out[1]["error"]
