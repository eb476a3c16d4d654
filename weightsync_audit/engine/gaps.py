"""How large a divergence is: ``max_abs_diff`` between two copies of a tensor.

Kept apart from the engine so that ``weightsync-audit diff`` measures checkpoints without loading the
audit channel.
"""

from __future__ import annotations

import math

import torch

__all__ = ["max_abs_diff"]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.dtype == torch.bool:
        return float((a != b).any())
    if a.is_complex():
        d = (a.to(torch.complex128) - b.to(torch.complex128)).abs()
    elif a.is_floating_point():
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        d = (a64 - b64).abs()
        both_nan = torch.isnan(a64) & torch.isnan(b64)
        same_inf = torch.isinf(a64) & (a64 == b64)
        d = torch.where(both_nan | same_inf, torch.zeros_like(d), d)
        d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    else:
        d = (a.to(torch.float64) - b.to(torch.float64)).abs()
    return float(d.max()) if d.numel() else 0.0
