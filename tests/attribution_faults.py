"""The faults of the attribution proofs, on a plain DDP + Adam loop (2 gloo ranks): one rank, one step.

Shared by tests/test_attribution.py and the attribution campaign (benchmarks/campaign_attribution.py).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ATTRIBUTION_FAULTS: dict[str, tuple[str, bool]] = {
    "flip_at_rest": ("at_rest_change", True),
    "flip_state_at_rest": ("at_rest_change", True),
    "update_ulp": ("update_not_reproducible", True),
    "grad_after_reduce": ("deterministic_difference", False),
    "lr_one_rank": ("deterministic_difference", False),
    "skip_step": ("deterministic_difference", False),
    "collective_bytes": ("collective_mismatch", False),
}
"""Fault kind -> (the evidence the blame must give, hardware_suspect)."""

FAULT_STEP = 4


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: its kind, the rank it hits, the step, and where (parameter index, element, bit)."""

    kind: str | None
    rank: int = 0
    step: int = FAULT_STEP
    param: int = 0
    element: int = 5
    bit: int = 27


class FaultyAdam(torch.optim.Adam):
    """Adam whose update of one element is off by one ulp at one step (a compute fault inside the step)."""

    fault_at: int | None = None
    fault_param: int = 0
    fault_element: int = 3
    taken = 0

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        self.taken += 1
        if self.taken == self.fault_at:
            with torch.no_grad():
                w = self.param_groups[0]["params"][self.fault_param].view(-1)
                i = self.fault_element % w.numel()
                w[i] = torch.nextafter(w[i], torch.tensor(math.inf, device=w.device))
        return out


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of one float32 element in place, as the memory does: behind torch's back, so that no version
    counter moves (on the CPU by its address; elsewhere through ``.data``, whose counter is its own)."""
    index %= t.numel()
    if t.is_cpu and t.is_contiguous():
        word = ctypes.c_uint32.from_address(t.data_ptr() + 4 * index)
        word.value ^= 1 << bit
        return
    with torch.no_grad():
        t.data.view(-1)[index : index + 1].view(torch.int32).bitwise_xor_(1 << bit)


def build(rank: int, device: str = "cpu") -> tuple[nn.Module, DDP, FaultyAdam]:
    """The model of rank ``rank`` on ``device`` (the same on every rank), its DDP and its :class:`FaultyAdam`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    ddp = DDP(model)
    return model, ddp, FaultyAdam(ddp.parameters(), lr=1e-2)


def _spec(fault: str | Fault | None, faulty: int) -> Fault:
    return fault if isinstance(fault, Fault) else Fault(fault, faulty)


def train_step(
    ddp: DDP, opt: torch.optim.Optimizer, rank: int, step: int, fault: str | Fault | None, faulty: int = 0
) -> None:
    """One step; ``fault`` (a kind on rank ``faulty`` at :data:`FAULT_STEP`, or a :class:`Fault`)."""
    f = _spec(fault, faulty)
    g = torch.Generator().manual_seed(1000 * step + rank)
    dev = next(ddp.parameters()).device
    x, y = torch.randn(4, 8, generator=g).to(dev), torch.randn(4, 4, generator=g).to(dev)
    at = step == f.step and rank == f.rank
    if at and f.kind == "lr_one_rank":
        for group in opt.param_groups:
            group["lr"] *= 10
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    if at and f.kind == "grad_after_reduce":
        with torch.no_grad():
            list(ddp.parameters())[f.param].grad.mul_(0.5)
    if isinstance(opt, FaultyAdam):
        opt.fault_at = opt.taken + 1 if at and f.kind == "update_ulp" else None
        opt.fault_param, opt.fault_element = f.param, f.element
    if not (at and f.kind == "skip_step"):
        opt.step()


def after_step(ddp: DDP, rank: int, step: int, fault: str | Fault | None, faulty: int = 0, opt: Any = None) -> None:
    """After the step and its audit: a bit flip at rest (seen before the next optimizer step)."""
    f = _spec(fault, faulty)
    if rank != f.rank or step != f.step - 1:
        return
    p = list(ddp.parameters())[f.param]
    if f.kind == "flip_at_rest":
        flip_bit(p, f.element, f.bit)
    elif f.kind == "flip_state_at_rest" and opt is not None:
        flip_bit(opt.state[p]["exp_avg"], f.element, f.bit)


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
