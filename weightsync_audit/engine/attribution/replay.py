"""The step re-checked: the update replayed on a pre-step copy, and the collective's result digested.

The update: replay a rank's own optimizer step on a pre-step copy, and compare.

Right before the step, :class:`UpdateReplay` copies what the update reads for the parameters it covers
(the parameter, its gradient, its optimizer state, its group's hyperparameters, and a ``GradScaler``'s
``grad_scale`` and ``found_inf`` where the optimizer unscales and skips inside its own step, as fused
Adam does); right after, it runs the same torch optimizer class, with the same implementation flags
(``fused``, ``foreach``), on the copies and compares the bytes with what the real step wrote. A rank
whose own update does not reproduce computed it wrong (hardware-suspect); a rank that reproduces its own
result differs, if at all, by what went in (software).

What it covers is bounded per step: ``slices`` (1 parameter in n, rotating) and ``budget`` (bytes copied
per step: parameters taken in turn until it is spent, whole parameters only, so each is replayed with
the very kernels and layout of the real step). A parameter larger than the whole budget is never
replayed, and the record says how much was. An update that cannot be replayed faithfully is declined,
with the reason: an optimizer that re-evaluates the model inside its step (``LBFGS``'s closure), one that
is not a torch class, one that cannot be rebuilt from its groups.

The replayed values of what reproduced are kept until the next step: they are this rank's post-step
bytes, against which a change at rest is counted (:mod:`.atrest`).

The collective: a DDP communication hook that digests every reduced gradient bucket.

:func:`attach_collective` wraps the hook DDP would run (its default all-reduce, or the user's own) and,
when the bucket's reduction completes, digests it, in one read: one word per gradient in it, and one per
bucket folded from them (compared across ranks at a divergent audit: "the all-reduce of bucket 3 gave
other bytes on rank 1"); the gradients' words are compared, on the same rank, with the gradient right
before the optimizer step (a gradient changed after the all-reduce). Local: no message is added to the step.

>>> import torch
>>> p = torch.nn.Parameter(torch.ones(3))
>>> opt = torch.optim.Adam([p], lr=0.1)
>>> p.grad = torch.full((3,), 0.5)
>>> replay = UpdateReplay(slices=1)
>>> replay.before(opt)
>>> opt.step()
>>> replay.after(opt), replay.covered, replay.replayable
([], 1, 1)
"""

from __future__ import annotations

import inspect
import math
import time
from typing import Any, Callable

import torch
import torch.distributed

from weightsync_audit.channel.store import Worker
from weightsync_audit.compat import tensor_version
from weightsync_audit.engine.hashing.digest import digest_tensors, overall_digest

__all__ = ["ReducedDigests", "UpdateReplay", "attach_collective", "declined_reason", "torch_class"]

_SCALER_ATTRS = ("grad_scale", "found_inf")
"""What a ``GradScaler`` sets on an optimizer that unscales and skips inside its own step (fused Adam)."""


def torch_class(opt: torch.optim.Optimizer) -> type[torch.optim.Optimizer] | None:
    """The torch optimizer class ``opt`` runs (its own, or the torch class a subclass extends)."""
    for cls in type(opt).__mro__:
        if cls.__module__.startswith("torch.optim") and cls is not torch.optim.Optimizer:
            return cls
    return None


def _needs_closure(cls: type[torch.optim.Optimizer]) -> bool:
    closure = inspect.signature(cls.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def declined_reason(opt: torch.optim.Optimizer) -> str | None:
    """Why ``opt``'s update cannot be replayed faithfully from copies (None: it can)."""
    cls = torch_class(opt)
    name = type(opt).__name__
    if cls is None:
        return f"{name} is not a torch.optim class: its update is not replayed"
    if _needs_closure(cls):
        return (
            f"{name} re-evaluates the model through its closure inside the step: its update cannot be replayed "
            "from copies (the at-rest and collective checks still run)"
        )
    if any(g.get("differentiable") for g in opt.param_groups):
        return f"{name} runs with differentiable=True: its update is not replayed"
    return None


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _nbytes(p: torch.Tensor, state: dict[str, Any]) -> int:
    return 2 * p.nbytes + sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))


class UpdateReplay:
    """Copies before the step (bounded by ``slices`` and ``budget``, rotating), replays after it."""

    def __init__(self, slices: int, budget: int = 0, method: str = "auto", keep_words: bool = False) -> None:
        self.slices = max(1, slices)
        self.budget = budget
        self.method = method
        self.keep_words = keep_words
        """Keep :attr:`words` (the at-rest check reads them when its own reads are offloaded)."""
        self.names: dict[int, str] = {}
        """id(parameter) -> its name, for what :meth:`after` returns."""
        self._kept: dict[int, tuple[list[tuple[dict[str, Any], list[Any]]], dict[str, Any]]] = {}
        self._cursor: dict[int, int] = {}
        self.covered = 0
        """Parameters replayed at the last step."""
        self.replayable = 0
        """Parameters with a gradient at the last step (what a full replay covers)."""
        self.too_large = 0
        """Parameters larger than the whole budget at the last step: never replayed."""
        self.declined: str | None = None
        """Why the last step's update was not replayed (None: it was, or nothing to replay)."""
        self.reference: dict[str, torch.Tensor] = {}
        """Name -> the replayed post-step value of each tensor that reproduced (parameter and its state);
        the watch empties it when the next step opens."""
        self.words: dict[str, tuple[int, int]] = {}
        """Name -> the digest (``method``) of each tensor that reproduced, read right after the step (the bytes the
        step wrote: the at-rest check's post-step word where its own read comes later, on a worker), and the id
        of the tensor read."""

    def before(self, opt: torch.optim.Optimizer) -> None:
        """Right before ``opt.step()``: copy what the update of the covered parameters reads."""
        self.declined = declined_reason(opt)
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None and not p.grad.is_sparse]
        self.replayable, self.too_large = len(params), 0
        if self.declined is not None or not params:
            self._kept[id(opt)] = ([], {})
            return
        take = self._select(opt, params)
        groups: list[tuple[dict[str, Any], list[Any]]] = []
        for group in opt.param_groups:
            kept = [
                (p, p.detach().clone(), p.grad.detach().clone(), {k: _copy(v) for k, v in opt.state.get(p, {}).items()})
                for p in group["params"]
                if id(p) in take
            ]
            if kept:
                groups.append(({k: v for k, v in group.items() if k != "params"}, kept))
        scaler = {a: _copy(getattr(opt, a)) for a in _SCALER_ATTRS if getattr(opt, a, None) is not None}
        self._kept[id(opt)] = (groups, scaler)

    def copies(self, opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The parameters :meth:`before` copied for ``opt``'s step, each with its copy (read-only until
        :meth:`after` replays the update on the copies)."""
        groups, _ = self._kept.get(id(opt), ([], {}))
        return [(real, value) for _, kept in groups for real, value, _, _ in kept]

    def _select(self, opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> set[int]:
        """The parameters this step covers: the next ones in turn, at most 1 in ``slices`` and ``budget`` bytes."""
        n = len(params)
        count = math.ceil(n / self.slices)
        start = self._cursor.get(id(opt), 0) % n
        take: set[int] = set()
        spent, looked = 0, 0
        while looked < n and len(take) < count:
            p = params[(start + looked) % n]
            looked += 1
            size = _nbytes(p, opt.state.get(p, {}))
            if self.budget and size > self.budget:
                self.too_large += 1
                continue
            if self.budget and spent + size > self.budget:
                looked -= 1  # its turn comes first at the next step
                break
            take.add(id(p))
            spent += size
        self._cursor[id(opt)] = (start + looked) % n
        return take

    def after(self, opt: torch.optim.Optimizer) -> list[str]:
        """Right after ``opt.step()``: replay on the copies; the names whose bytes the replay does not give."""
        groups, scaler = self._kept.pop(id(opt), ([], {}))
        cls = torch_class(opt)
        self.covered, self.words = 0, {}
        if not groups or cls is None:
            return []
        replay_groups, pairs = [], []
        for hyper, kept in groups:
            params = []
            for real, value, grad, state in kept:
                copy = value.requires_grad_(real.requires_grad)
                copy.grad = grad
                params.append(copy)
                pairs.append((real, copy, state))
            replay_groups.append({**hyper, "params": params})
        try:
            replayed = cls(replay_groups)
            for _, copy, state in pairs:
                if state:
                    replayed.state[copy] = state
            for attr, value in scaler.items():
                setattr(replayed, attr, value)
            replayed.step()
        except Exception as exc:  # noqa: BLE001 - said in the record and warned, never silent
            self.declined = f"{type(opt).__name__}'s update could not be replayed ({type(exc).__name__}: {exc})"[:300]
            return []
        self.covered = len(pairs)
        bad = []
        for real, copy, _ in pairs:
            name = self.names.get(id(real), f"param {len(bad)}")
            state = opt.state.get(real, {})
            again_state = replayed.state.get(copy, {})
            keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
            mine = [real.detach(), *[state[k] for k in keys]]
            again = [copy.detach(), *[v for v in again_state.values() if isinstance(v, torch.Tensor)]]
            words = digest_tensors(mine, method=self.method)
            if len(mine) != len(again) or (words != digest_tensors(again, method=self.method)).any():
                bad.append(name)
                continue
            if self.keep_words:
                self.words[name] = (int(words[0]), id(real))
                self.words.update((f"{name}.{k}", (int(w), id(state[k]))) for k, w in zip(keys, words[1:]))
            self.reference[name] = copy.detach()
            for k, v in again_state.items():
                if isinstance(v, torch.Tensor) and v.dim():
                    self.reference[f"{name}.{k}"] = v
        return bad


class ReducedDigests:
    """What the hook saw since the last optimizer step: bucket index -> digest, id(param) -> digest.

    ``deferred`` (with ``overlap``): the digests are taken on that worker, after the hook returns; a bucket
    whose buffer moved (its version counter) before the worker read it is left out, never guessed."""

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.grads: dict[int, int] = {}
        self.hook_s = 0.0
        """Seconds the hook's own work took, in all (inside DDP's reduction: on the critical path)."""
        self.deferred: Worker | None = None

    def take(self, *, wait: bool = True, keep: bool = False) -> tuple[dict[int, int], dict[int, int]]:
        """The digests of this step's reductions, and (unless ``keep``) a fresh start for the next step (``wait``:
        for the deferred digests first; a job on the worker itself passes False, the earlier jobs having run)."""
        if wait and self.deferred is not None:
            self.deferred.drain()
        out = self.buckets, self.grads
        if not keep:
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
