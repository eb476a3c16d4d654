"""The faults of the attribution proofs, on a plain DDP + Adam loop (2 gloo ranks): one rank, one step.

Shared by tests/test_attribution.py and the campaign (benchmarks/campaign_attribution.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ATTRIBUTION_FAULTS: dict[str, tuple[str, bool]] = {
    "flip_at_rest": ("at_rest_change", True),
    "update_ulp": ("update_not_reproducible", True),
    "grad_after_reduce": ("deterministic_difference", False),
    "lr_one_rank": ("deterministic_difference", False),
    "collective_bytes": ("collective_mismatch", False),
}
"""Fault kind -> (the evidence the blame must give, hardware_suspect)."""

FAULT_STEP = 4


class FaultyAdam(torch.optim.Adam):
    """Adam whose update of one element is off by one ulp at one step (a compute fault inside the step)."""

    fault_at: int | None = None
    taken = 0

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        self.taken += 1
        if self.taken == self.fault_at:
            with torch.no_grad():
                w = self.param_groups[0]["params"][0].view(-1)
                w[3] = torch.nextafter(w[3], torch.tensor(math.inf))
        return out


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of one float32 element, in place (a bit flip at rest)."""
    with torch.no_grad():
        flat = t.view(-1)
        as_int = flat[index : index + 1].view(torch.int32)
        as_int ^= 1 << bit


def build(rank: int) -> tuple[nn.Module, DDP, FaultyAdam]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = DDP(model)
    return model, ddp, FaultyAdam(ddp.parameters(), lr=1e-2)


def train_step(ddp: DDP, opt: torch.optim.Optimizer, rank: int, step: int, fault: str | None, faulty: int) -> None:
    """One step; the fault of ``fault`` on rank ``faulty`` at :data:`FAULT_STEP`."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    at = step == FAULT_STEP and rank == faulty
    if at and fault == "lr_one_rank":
        for group in opt.param_groups:
            group["lr"] *= 10
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    if at and fault == "grad_after_reduce":
        with torch.no_grad():
            next(ddp.parameters()).grad.mul_(0.5)
    if isinstance(opt, FaultyAdam):
        opt.fault_at = opt.taken + 1 if at and fault == "update_ulp" else None
    opt.step()


def after_step(ddp: DDP, rank: int, step: int, fault: str | None, faulty: int) -> None:
    """After the step and its audit: the bit flip at rest (seen before the next optimizer step)."""
    if fault == "flip_at_rest" and rank == faulty and step == FAULT_STEP - 1:
        flip_bit(next(ddp.parameters()), 5, 27)


def corrupting_hook(faulty: int, rank: int, at_call: int) -> Any:
    """DDP's all-reduce, whose result on rank ``faulty`` is changed at its ``at_call``-th bucket reduction."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = [0]

    def hook(state: Any, bucket: Any) -> Any:
        calls[0] += 1
        mine = calls[0]

        def bad(fut: Any) -> torch.Tensor:
            value = fut.value()
            t = value[0] if isinstance(value, (list, tuple)) else value
            if rank == faulty and mine == at_call:
                t[0] += 1e-3
            return t

        return allreduce_hook(state, bucket).then(bad)

    return hook
