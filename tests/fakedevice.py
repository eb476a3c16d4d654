"""Stand-ins for accelerator tensors on a CPU-only machine.

:class:`FakeAccel` is not on the CPU (``is_cpu`` is false) and its host copies (``.cpu()``,
``.to("cpu")``: fresh buffers; ``host.copy_(fake)``: a write into host memory) behave as a real
device's do; every byte copied to the host is counted in :data:`COPIED`. :class:`MetaAccel` also reports its device as ``meta``, a device type whose kernels
compute nothing readable: what a backend without exact int64 arithmetic looks like to the probe.
"""

from __future__ import annotations

from typing import Any

import torch

COPIED = {"bytes": 0, "copies": 0, "largest": 0}
"""Host copies made from fake accelerator tensors since the last :func:`reset_copies`."""


def reset_copies() -> None:
    COPIED.update(bytes=0, copies=0, largest=0)


def _count(nbytes: int) -> None:
    COPIED["bytes"] += nbytes
    COPIED["copies"] += 1
    COPIED["largest"] = max(COPIED["largest"], nbytes)


class FakeAccel(torch.Tensor):
    """An accelerator tensor stand-in whose host copies are fresh, counted buffers."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is torch.Tensor.is_cpu:
            return False
        if owner is torch.Tensor.device and cls.device_type is not None:
            return torch.device(cls.device_type)
        if func is torch.Tensor.copy_ and isinstance(args[1], FakeAccel) and not isinstance(args[0], FakeAccel):
            with torch._C.DisableTorchFunctionSubclass():  # a copy from the "device" into host memory
                args[0].copy_(args[1].as_subclass(torch.Tensor), **kwargs)
            _count(args[0].nbytes)
            return args[0]
        if func in (torch.Tensor.cpu, torch.Tensor.to):
            with torch._C.DisableTorchFunctionSubclass():
                plain = args[0].as_subclass(torch.Tensor)
                out = func(plain, *args[1:], **kwargs).clone()
            _count(out.nbytes)
            return out
        return super().__torch_function__(func, types, args, kwargs)

    device_type: str | None = None


class MetaAccel(FakeAccel):
    """A :class:`FakeAccel` that says it lives on the ``meta`` device."""

    device_type = "meta"


def fake(t: torch.Tensor, cls: type[FakeAccel] = FakeAccel) -> torch.Tensor:
    """``t`` as a fake accelerator tensor (the same memory)."""
    return t.as_subclass(cls)
