"""Pinpoint while other tensors drift within the tolerance (issue 30, item 15): a tensor frozen on one rank
never gets an ``exact`` first step that is not the first step the bytes differed. The truth is the test's
own: every parameter all-gathered after every step and compared with ``torch.equal``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

from weightsync_audit import Auditor


def _differing(model: nn.Module, world: int) -> list[str]:
    out = []
    for n, p in model.named_parameters():
        got = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(got, p.detach().contiguous())
        if not all(torch.equal(got[0], g) for g in got[1:]):
            out.append(n)
    return out


def _frozen_while_drifting(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's ``0.weight`` gradient carries 1e-5 relative noise from step 3 (drift within the tolerance);
    from step 7 rank 1's ``1.weight`` no longer moves (frozen). Adam, audits every 5 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    auditor = Auditor(model, opt, pinpoint=True, tolerance=1e-3)
    data, noise = torch.Generator().manual_seed(5), torch.Generator().manual_seed(9)
    frozen = model[1].weight
    truth: dict[int, list[str]] = {}
    records = []
    for step in range(1, 16):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
        for n, p in model.named_parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
            if rank == 1 and step >= 3 and n == "0.weight":
                p.grad.mul_(1 + 1e-5 * torch.randn(p.grad.shape, generator=noise))
        before = frozen.detach().clone()
        opt.step()
        if rank == 1 and step >= 7:
            with torch.no_grad():
                frozen.copy_(before)
        truth[step] = _differing(model, world)
        auditor.record_step(step)
        if step % 5 == 0:
            r = auditor.audit(step=step).to_dict()
            records.append({k: v for k, v in r.items() if k not in ("time", "duration_ms")})
    return {"truth": truth, "records": records}


def test_a_tensor_frozen_on_one_rank_while_another_drifts_keeps_the_first_step_the_bytes_differed() -> None:
    out = run_ranks(_frozen_while_drifting, 2)
    assert out[0]["records"] == out[1]["records"]
    truth = out[0]["truth"]
    first = min(s for s, names in truth.items() if names)
    first_frozen = min(s for s, names in truth.items() if "1.weight" in names)
    assert (first, first_frozen) == (3, 7)  # the drift came first, the frozen tensor four steps later
    at5, at10, at15 = out[0]["records"]
    assert at5["within_tolerance"] is True and (at5["pinpoint"], at5["first_diverged_step"]) == ("exact", first)
    for rec in (at10, at15):
        beyond = [m["name"] for m in rec["mismatches"] if not m.get("within_tolerance")]
        assert beyond == ["1.weight"], rec["mismatches"]
        # Exact means the first step the bytes differed, and the step before it really agreed.
        assert (rec["pinpoint"], rec["first_diverged_step"], rec["last_in_sync_step"]) == ("exact", first, first - 1)
        assert truth[first - 1] == []
        said = f"began at step {first_frozen} (exact, the last step before it {first_frozen - 1})"
        assert any(said in n for n in rec["notes"]), rec["notes"]


def _within_then_beyond(rank: int, world: int) -> list[dict[str, Any]]:
    """lr 0: only the planted changes move. Rank 1: ``0.weight`` nudged within the tolerance at 3,
    ``1.weight`` nudged within it at 4 (so it is left out of the per-step digests at the audit at 5) and
    far beyond it at 7."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    auditor = Auditor(model, opt, pinpoint=True, tolerance=1e-5)
    out = []
    for step in range(1, 11):
        with torch.no_grad():
            if rank == 1 and step == 3:
                model[0].weight.mul_(1 + 2e-7)
            if rank == 1 and step == 4:
                model[1].weight.mul_(1 + 2e-7)
            if rank == 1 and step == 7:
                model[1].weight.mul_(1.01)
        auditor.record_step(step)
        if step % 5 == 0:
            out.append(auditor.audit(step=step).to_dict())
    return out


def test_a_tensor_left_out_within_the_tolerance_that_goes_beyond_it_is_never_dated_to_a_later_exact_step() -> None:
    at5, at10 = run_ranks(_within_then_beyond, 2)[0]
    assert at5["within_tolerance"] is True and (at5["pinpoint"], at5["first_diverged_step"]) == ("exact", 3)
    assert [m["name"] for m in at10["mismatches"] if not m.get("within_tolerance")] == ["1.weight"]
    # Its per-step digests were left out since step 5: the step it went beyond (7) cannot be told, and
    # the record says so; its first step stays the first step the bytes differed (3).
    assert (at10["pinpoint"], at10["first_diverged_step"], at10["last_in_sync_step"]) == ("exact", 3, 2)
    assert any("when they went beyond it is not known" in n for n in at10["notes"]), at10["notes"]
