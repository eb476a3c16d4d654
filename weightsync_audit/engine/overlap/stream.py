"""Where an overlapped audit's device work runs: a side stream ordered after the optimizer step by an event.

On the CPU there is nothing to order: the audit's worker thread reads host memory, and the optimizer's
pre-step hook waits for it. On an accelerator the step's kernels may still be queued when the audit is
launched; :meth:`StreamOrder.at_launch` records an event on the training thread's current stream right
after the step, and the worker's side stream waits for that event before its digest kernels, so they
read the step's result and nothing later, while the training's next forward and backward run on their own
stream. The worker synchronizes its own stream only (:func:`~weightsync_audit.compat.stream_ordered`),
never the device: a device-wide wait would wait for the training's next kernels too.

A write that the step queues on *another* stream than the current one must be ordered before the launch by
the training itself (the stream it ran on waited for, or the current stream made to wait); the synchronous
audit, which waits for the whole device, needs no such care.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Sequence

import torch

from weightsync_audit.compat import stream_ordered

__all__ = ["StreamOrder", "accelerator_of"]


def accelerator_of(tensors: Sequence[Any]) -> torch.device | None:
    """The first accelerator device among ``tensors`` (``None``: all on the CPU, or none at all)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
            return t.device
    return None


class StreamOrder:
    """An event on the training's stream and the side stream that waits for it (one per device, reused)."""

    _side: dict[torch.device, Any] = {}

    def __init__(self, device: torch.device, module: Any, event: Any, side: Any) -> None:
        self.device, self.module, self.event, self.side = device, module, event, side

    @classmethod
    def at_launch(cls, device: torch.device | None) -> StreamOrder | None:
        """On the training thread, right after the step: the event that the worker's stream will wait for."""
        if device is None:
            return None
        module = getattr(torch, device.type, None)
        if module is None or not all(hasattr(module, n) for n in ("Stream", "Event", "current_stream", "stream")):
            return None  # a device type without streams: its work is ordered on the one queue it has
        if device.index is None:
            device = torch.device(device.type, module.current_device())
        side = cls._side.get(device)
        if side is None:
            side = cls._side[device] = module.Stream(device=device)
        event = module.Event()
        event.record(module.current_stream(device))
        return cls(device, module, event, side)

    @classmethod
    def devices(cls) -> list[torch.device]:
        """The devices on which an overlapped audit has had a side stream in this process."""
        return list(cls._side)

    @contextmanager
    def on_worker(self) -> Iterator[None]:
        """On the worker thread: this device current, the side stream current and waiting for the event."""
        with ExitStack() as stack:
            if hasattr(self.module, "device"):
                stack.enter_context(self.module.device(self.device))
            stack.enter_context(self.module.stream(self.side))
            self.side.wait_event(self.event)
            stack.enter_context(stream_ordered())
            yield
            self.side.synchronize()  # nothing the digest queued outlives the audit
