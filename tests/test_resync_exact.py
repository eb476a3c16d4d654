"""After ``resync`` every replica is bit-identical to the source: parameters, buffers and optimizer state
(tensors and Python values), checked independently of the auditor's own digests (sha256 of every
value's bytes, types and dtypes included)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

from weightsync_audit import audit, resync


def _fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 over names, types, dtypes, shapes and exact bytes of everything resync promises to copy."""
    h = hashlib.sha256()

    def feed(name: str, v: Any) -> None:
        h.update(name.encode() + b"\0" + type(v).__name__.encode() + b"\0")
        if isinstance(v, torch.Tensor):
            t = v.detach().contiguous().cpu()
            h.update(f"{t.dtype}{tuple(t.shape)}{t.device.type}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(v).encode())

    for n, t in model.state_dict(keep_vars=True).items():
        feed(n, t)
    sd = opt.state_dict()
    for pid in sorted(sd["state"]):
        for k in sorted(sd["state"][pid]):
            feed(f"state.{pid}.{k}", sd["state"][pid][k])
    for gi, g in enumerate(sd["param_groups"]):
        for k in sorted(g):
            feed(f"group.{gi}.{k}", g[k])
    return h.hexdigest()


def _make(rank: int, opt_name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(rank)  # every rank different
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    if opt_name == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-3 * (rank + 1), betas=(0.9, 0.99 - 0.01 * rank)
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9, nesterov=True)
    for _ in range(rank + 1):  # different numbers of steps: different step counters and moments
        model(torch.randn(5, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # NaN and -0.0 must travel bit-exactly too
        model[3].bias[0] = float("nan") if rank == 2 else -0.0
    return model, opt


def _resync_exact(rank: int, world: int, src: int, opt_name: str) -> dict[str, Any]:
    model, opt = _make(rank, opt_name)
    before = _fingerprint(model, opt)
    resync(model, opt, src=src, timeout_s=30)
    after = _fingerprint(model, opt)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, after)
    step = opt.state[model[0].weight].get("step")
    return {
        "before": before,
        "all_after": gathered,
        "audit_in_sync": audit(model, opt, timeout_s=30).in_sync,
        "step_type": type(step).__name__ if step is not None else None,
        "betas_type": type(opt.param_groups[0].get("betas", ())).__name__,
    }


@pytest.mark.parametrize("world,src,opt_name", [(2, 0, "adamw"), (3, 2, "adamw"), (3, 1, "sgd")])
def test_resync_leaves_every_replica_bit_identical_to_the_source(world: int, src: int, opt_name: str) -> None:
    results = run_ranks(_resync_exact, world, src, opt_name, timeout=90)
    source_before = results[src]["before"]
    assert len({r["before"] for r in results}) == world  # they did differ
    for rank, r in enumerate(results):
        assert r["all_after"] == [source_before] * world, f"rank {rank} differs from the source after resync"
        assert r["audit_in_sync"] is True
        if opt_name == "adamw":
            assert r["step_type"] == "Tensor" and r["betas_type"] == "tuple"  # types survive, not only bytes


def _state_for_a_parameter_missing_here(rank: int, world: int) -> dict[str, Any]:
    """Rank 0's optimizer holds state for both layers; rank 1's optimizer covers only the first, fresh."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    params = list(model.parameters()) if rank == 0 else list(model[0].parameters())
    opt = torch.optim.Adam(params, lr=0.1)
    if rank == 0:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    before = _fingerprint(model, opt)
    try:
        resync(model, opt, src=0, timeout_s=20)
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"error": error, "unchanged": _fingerprint(model, opt) == before}


def test_a_resync_refused_on_one_rank_is_refused_on_every_rank_and_changes_nothing() -> None:
    r0, r1 = run_ranks(_state_for_a_parameter_missing_here, 2, timeout=60)
    assert r0["error"] is not None and r0["error"] == r1["error"], (r0, r1)  # every rank ends together
    assert "rank 1: optimizer state '1.weight." in r0["error"], r0["error"]
    assert r0["unchanged"] and r1["unchanged"], (r0, r1)


def _experts(rank: int, world: int) -> dict[str, Any]:
    """Ranks {0, 2} hold ``experts.0``, {1, 3} hold ``experts.1``; rank 3's copy changed, then resync(src=0)."""
    from weightsync_audit import declare_replicas

    torch.manual_seed(0)
    model = nn.Module()
    model.shared = nn.Linear(4, 4)
    model.experts = nn.ModuleDict({str(rank % 2): nn.Linear(4, 4)})
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    declare_replicas(model, experts="experts.*", expert_group=groups[rank % 2])
    w = model.experts[str(rank % 2)].weight
    if rank == 3:
        with torch.no_grad():
            w[0, 0] += 1.0
    before = [(m["name"], m["ranks"]) for m in audit(model).to_dict()["mismatches"]]
    resync(model, src=0, timeout_s=20)
    got = [torch.zeros_like(w) for _ in range(world)]
    dist.all_gather(got, w.detach())  # the truth: each expert's copies, gathered
    return {"before": before, "equal": [torch.equal(got[0], got[2]), torch.equal(got[1], got[3])]}


def test_resync_copies_an_expert_within_the_ranks_holding_it() -> None:
    out = run_ranks(_experts, 4, timeout=60)
    assert out[0]["before"] == [("experts.1.weight", [3])], out[0]["before"]
    assert all(o["equal"] == [True, True] for o in out), out  # rank 3 got rank 1's copy; src=0 holds none
