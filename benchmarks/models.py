"""The models the benchmarks audit: GPT-shaped stacks of a given size, and a model of many tiny tensors.

Shapes matter more than semantics here: the digest's cost depends on how many tensors there are and how
big they are, so the stacks have the tensor mix of a small transformer (large matrices, small biases and
norms). Weights are filled from a fixed seed, so every rank that builds one holds the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

VOCAB = 8192


class Block(nn.Module):
    """Attention-and-MLP-shaped parameters (the forward pass is never run here)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)


class TinyGPT(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)


class ManySmall(nn.Module):
    """``n`` tiny tensors: 16x16 weights and 16-element biases, alternating."""

    def __init__(self, n: int = 5000) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(n // 2))


@dataclass(frozen=True)
class ModelSpec:
    label: str
    kind: str  # "gpt" or "small"
    d: int = 0
    layers: int = 0
    dtype: torch.dtype = torch.float32


SPECS = {
    "10M": ModelSpec("10M fp32", "gpt", d=256, layers=10),
    "100M": ModelSpec("100M fp32", "gpt", d=768, layers=13),
    "400M": ModelSpec("400M fp32", "gpt", d=1024, layers=31),
    "100M-bf16": ModelSpec("100M bf16", "gpt", d=768, layers=13, dtype=torch.bfloat16),
    "5000-small": ModelSpec("5,000 small tensors", "small"),
}


def build(spec: ModelSpec, seed: int = 0) -> nn.Module:
    """The model, materialised on CPU with seeded values (cheap: no per-layer init schemes)."""
    with torch.device("meta"):
        model: nn.Module = TinyGPT(spec.d, spec.layers) if spec.kind == "gpt" else ManySmall()
    model = model.to_empty(device="cpu").to(spec.dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype.is_floating_point:
                p.uniform_(-0.05, 0.05, generator=g)
    return model


def nbytes(model: nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters())


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
