"""The collective checked: a DDP communication hook that digests every reduced gradient bucket.

:func:`attach_collective` wraps the hook DDP would run (its default all-reduce, or the user's own) and,
when the bucket's reduction completes, digests it, in one read: one word per gradient in it, and one per
bucket folded from them (compared across ranks at a divergent audit: "the all-reduce of bucket 3 gave
other bytes on rank 1"); the gradients' words are compared, on the same rank, with the gradient right
before the optimizer step (a gradient changed after the all-reduce). Local: no message is added to the step.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed

from weightsync_audit.compat import tensor_version
from weightsync_audit.engine.attribution.offload import Deferred
from weightsync_audit.engine.hashing.digest import digest_tensors, overall_digest

__all__ = ["ReducedDigests", "attach_collective"]


class ReducedDigests:
    """What the hook saw since the last optimizer step: bucket index -> digest, id(param) -> digest.

    ``deferred`` (with ``overlap``): the digests are taken on that worker, after the hook returns; a bucket
    whose buffer moved (its version counter) before the worker read it is left out, never guessed."""

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.grads: dict[int, int] = {}
        self.hook_s = 0.0
        """Seconds the hook's own work took, in all (inside DDP's reduction: on the critical path)."""
        self.deferred: Deferred | None = None

    def take(self, *, wait: bool = True) -> tuple[dict[int, int], dict[int, int]]:
        """The digests of this step's reductions, and a fresh start for the next step (``wait``: for the deferred
        digests first; a job on the worker itself passes False, the earlier jobs having run)."""
        if wait and self.deferred is not None:
            self.deferred.drain()
        out = self.buckets, self.grads
        self.buckets, self.grads = {}, {}
        return out

    def reduced(self, index: int, flat: torch.Tensor, params: list[Any], spans: list[tuple[int, int]]) -> None:
        """The reduced bucket ``index`` (``flat``), its parameters and their ``(offset, numel)`` in it."""
        t0 = time.perf_counter()
        if self.deferred is None:
            self._digest(index, flat, params, spans, None)
        else:
            stamp = tensor_version(flat)
            self.deferred.submit(lambda: self._digest(index, flat, params, spans, stamp))
        self.hook_s += time.perf_counter() - t0

    def _digest(
        self, index: int, flat: torch.Tensor, params: list[Any], spans: list[tuple[int, int]], stamp: int | None
    ) -> None:
        # One read of the bucket: its word is folded from its gradients' digests (what lies between them is
        # padding, which no gradient holds).
        try:
            digests = digest_tensors([flat.detach()[o : o + n] for o, n in spans])
        except Exception:  # noqa: BLE001 - a digest never breaks the user's step
            self.buckets[index] = 0
            return
        if stamp is not None and tensor_version(flat) != stamp:
            return  # DDP refilled the bucket before the worker read it: this step's word is unknown
        self.buckets[index] = int(overall_digest(digests, len(digests)))
        for p, d in zip(params, digests.tolist()):
            self.grads[id(p)] = d


def attach_collective(
    ddp: Any, into: ReducedDigests, hook: Callable[..., Any] | None = None, state: Any = None
) -> None:
    """Register on ``ddp`` a communication hook that runs ``hook`` (default: DDP's all-reduce) and digests
    what it returns into ``into``. DDP takes one hook: pass yours as ``hook`` (and its ``state``)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    inner = hook or allreduce_hook

    def digesting_hook(hook_state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        spans = [(g.storage_offset() - buf.storage_offset(), g.numel()) for g in bucket.gradients()]
        params, index = list(bucket.parameters()), bucket.index()

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            value = fut.value()
            flat = value[0] if isinstance(value, (list, tuple)) else value
            into.reduced(index, flat, params, spans)
            return flat

        return inner(hook_state, bucket).then(done)

    # DDP reads the hook's annotations as objects (this module's are strings): given as DDP expects them.
    digesting_hook.__annotations__ = {
        "hook_state": object,
        "bucket": torch.distributed.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    ddp.register_comm_hook(state, digesting_hook)
