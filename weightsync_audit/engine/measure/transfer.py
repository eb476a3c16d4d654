"""One tensor over the data plane: sent from its logical chunks, received chunk by chunk into a sink.

Both sides cut the tensor with :func:`~weightsync_audit.engine.hashing.reader.chunk_views`, which depends
on the shape and dtype only, so every chunk is received into a buffer of exactly the size sent (gloo
aborts the process on a size mismatch), whatever the layouts and devices on either side. A rank never
holds more than one chunk of the copy.
"""

from __future__ import annotations

from typing import Callable

import torch

from weightsync_audit.channel.dataplane import CHUNK_BYTES, DataPlane, Schedule, TransferFailure
from weightsync_audit.engine.hashing.reader import chunk_views, host_chunk

__all__ = ["Sink", "receive_tensor", "send_tensor", "tensor_bytes"]

Sink = Callable[[torch.Tensor, torch.Tensor], None]
"""Called with (this rank's view of the chunk, the received chunk as a CPU tensor of the same shape)."""


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _step(t: torch.Tensor) -> int:
    return max(1, CHUNK_BYTES // t.element_size())


def send_tensor(
    plane: DataPlane, t: torch.Tensor, alive: list[int], sched: Schedule, before: int
) -> dict[int, TransferFailure]:
    """Send ``t`` to each rank in ``alive``; a receiver that fails is removed from ``alive`` (in place)
    and the others still get it all. ``before`` is how many bytes of the plan precede this transfer
    (for the deadlines). Returns the failures by receiver.
    """
    failures: dict[int, TransferFailure] = {}
    fan_out = len(alive)
    done = 0
    for view in chunk_views(t.detach(), _step(t)):
        if not alive:
            break
        chunk = host_chunk(view).reshape(-1).view(torch.uint8)
        done += chunk.numel() * fan_out
        for dst, f in plane.send(chunk, alive, sched.deadline(before + done)).items():
            failures[dst] = f
            alive.remove(dst)
    return failures


def receive_tensor(
    plane: DataPlane, t: torch.Tensor, src: int, sched: Schedule, before: int, fan_out: int, sink: Sink
) -> tuple[TransferFailure | None, int, BaseException | None]:
    """Receive ``src``'s copy of ``t`` chunk by chunk, handing each to ``sink``.

    ``fan_out`` is how many ranks the sender serves (its bytes count against the deadlines). Returns
    (the transfer failure, chunks handed to the sink, the sink's first error). After a sink error the
    remaining chunks are still taken, so that the sender is never left waiting.
    """
    esize = t.element_size()
    step = _step(t)
    buf = torch.empty(min(step, t.numel()) * esize, dtype=torch.uint8)
    done = sunk = 0
    error: BaseException | None = None
    for view in chunk_views(t.detach(), step):
        n = view.numel() * esize
        done += n * fan_out
        try:
            plane.recv(buf[:n], src, sched.deadline(before + done))
        except TransferFailure as f:
            return f, sunk, error
        if error is not None:
            continue
        try:
            sink(view, buf[:n].view(t.dtype).reshape(view.shape))
            sunk += 1
        except Exception as exc:  # noqa: BLE001 - returned to the caller, which reports it
            error = exc
    return None, sunk, error
