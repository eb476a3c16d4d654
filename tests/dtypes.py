"""Every dtype the audit must handle, shared by the digest and the engine tests."""

import torch

#: float32/16, bfloat16, float8 (where this torch has it), ints, bool, complex.
ALL_DTYPES: list[torch.dtype] = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    *[getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)],
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
