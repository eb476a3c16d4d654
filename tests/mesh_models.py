"""Tiny sharded models for the mesh tests: FSDP2, HSDP and FSDP2 + tensor parallel on CPU gloo ranks."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


class TPNet(nn.Module):
    """``ln`` and ``dp1`` stay data-parallel only; ``tp_col``/``tp_row`` are tensor parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.dp1 = nn.Linear(8, 8)
        self.tp_col = nn.Linear(8, 16)
        self.tp_row = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp_row(torch.relu(self.tp_col(self.dp1(self.ln(x)))))


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 12)
        self.bn = nn.BatchNorm1d(12)
        self.fc2 = nn.Linear(12, 5)  # 5 rows: uneven shards on 2 and 4 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def dp_tp_model() -> tuple[nn.Module, object]:
    """FSDP2 over ``dp`` and Colwise/Rowwise over ``tp`` on a (dp=2, tp=2) mesh of 4 ranks."""
    torch.manual_seed(0)
    model = TPNet()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"tp_col": ColwiseParallel(), "tp_row": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def hsdp_model() -> tuple[nn.Module, object]:
    """HSDP: a (replicate=2, shard=2) mesh of 4 ranks."""
    torch.manual_seed(0)
    model = BNNet()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)
    return model, mesh


def fsdp_model(world: int) -> nn.Module:
    torch.manual_seed(0)
    model = BNNet()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    seed: int,
    noise: float = 0.0,
    noisy: tuple[str, ...] = (),
    noise_seed: int = 0,
) -> None:
    """``steps`` optimizer steps on batches seeded by ``seed``; ``noise`` (seeded by ``noise_seed``) is
    added to the local gradient shards of the modules named in ``noisy``."""
    g = torch.Generator().manual_seed(seed)
    gn = torch.Generator().manual_seed(1000 + noise_seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        model(x).square().mean().backward()
        for n, p in model.named_parameters():
            if noise and n.split(".")[0] in noisy and p.grad is not None:
                local = p.grad.to_local()
                local.add_(torch.randn(local.shape, generator=gn) * noise)
        opt.step()
        opt.zero_grad()
