"""The combination campaign's oracle: each rank's exact bytes at each point of a run, compared across ranks with
plain ``torch.distributed.all_gather`` and ``torch.equal``. Nothing from ``weightsync_audit`` is used.

A :class:`Capture` keeps, on its rank, a copy of the bytes (``uint8`` views, with dtype and shape) of every
parameter, buffer, optimizer state value, each param group's numeric hyper-parameters and every gradient, at
these points of each optimizer step ``s``:

- ``Q``: right before the update, after the step's closure (forward and backward) when there is one, and
  before the library's pre-step hooks (an optimizer pre-step hook registered first);
- ``P``: right before the update, after every global pre-step hook (where an overlapped audit is settled
  and acted on: a resync lands between ``Q`` and ``P``);
- ``E``: after the step and all the run's own post-step work, right before the adapter's after-step hook
  (what the audit of step ``s`` reads);
- ``X``: right after the adapter's after-step hook (a synchronous resync lands between ``E`` and ``X``).

At the end of the run :func:`gather` sends every rank's bytes to every rank (one ``all_gather_object`` for the
index, one ``all_gather`` of a ``uint8`` vector) and sorts the values of each tensor into classes of equal
bytes (``torch.equal``, after a cheap bucket by length and byte sum): two ranks hold the same value at two
points exactly when their class ids are equal.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

Key = tuple[str, str]
"""``(kind, name)``: kind ``param``, ``buffer``, ``optimizer``, ``grad`` or ``batch``; names as the audit's."""
Point = tuple[str, int]
"""``(label, step)``: label ``Q``, ``P``, ``E``, ``X`` or ``B`` (the step's batch)."""


def _bytes(v: Any) -> torch.Tensor | None:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()
    if isinstance(v, bool | int | float):
        return torch.tensor([float(v)], dtype=torch.float64).view(torch.uint8)
    return None


def _meta(v: Any) -> str:
    return f"{v.dtype}{list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__


def _flat(prefix: str, v: Any) -> list[tuple[str, Any]]:
    """A value and the items of a list or tuple it holds (LBFGS's histories, Adam's betas), by path."""
    if isinstance(v, (list, tuple)):
        return [item for i, x in enumerate(v) for item in _flat(f"{prefix}.{i}", x)]
    return [(prefix, v)]


def state_values(model: nn.Module, opt: torch.optim.Optimizer | None, hyper: bool) -> dict[Key, Any]:
    """Everything an audit of ``model`` and ``opt`` covers, named as the audit names it."""
    out: dict[Key, Any] = {}
    names = {}
    for n, p in model.named_parameters():
        names[id(p)] = n
        out[("param", n)] = p
        if p.grad is not None:
            out[("grad", n)] = p.grad
    for n, b in model.named_buffers():
        out[("buffer", n)] = b
    if opt is None:
        return out
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            for key, v in opt.state.get(p, {}).items():
                for name, x in _flat(f"{names.get(id(p), '?')}.{key}", v):
                    out[("optimizer", name)] = x
        if hyper:
            for key, v in group.items():
                if key != "params":
                    for name, x in _flat(f"param_groups.{gi}.{key}", v):
                        out[("optimizer", name)] = x
    return out


class Capture:
    """This rank's copies of the bytes at each point; :meth:`attach` hooks an optimizer for ``Q`` and ``P``."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
        self.model, self.opt = model, opt
        self.points: list[tuple[Point, dict[Key, tuple[str, torch.Tensor]]]] = []
        self._handles: list[Any] = []

    def snap(self, label: str, step: int, *, hyper: bool = True) -> None:
        vals = state_values(self.model, self.opt, hyper)
        kept = {}
        for k, v in vals.items():
            b = _bytes(v)
            if b is not None:
                kept[k] = (_meta(v), b)
        self.points.append(((label, step), kept))

    def batch(self, step: int, tensors: list[torch.Tensor]) -> None:
        """The bytes of the batch this rank trains step ``step`` on."""
        b = torch.cat([t.detach().reshape(-1).contiguous().view(torch.uint8) for t in tensors]).clone()
        self.points.append((("B", step), {("batch", "batch"): ("batch", b)}))

    def attach(self, opt: torch.optim.Optimizer, step: Callable[[], int]) -> None:
        """``Q`` from a global pre-step hook registered now (before the library's, which it registers later),
        ``P`` from a pre-step hook of ``opt`` (instance hooks run after every global one); with a closure, each
        right after the closure's first call returns."""
        self.opt = opt

        def hook(label: str) -> Callable[..., Any]:
            def pre(o: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                if o is not opt:
                    return None
                closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
                if not callable(closure):
                    self.snap(label, step(), hyper=False)
                    return None
                done = [False]

                def then_snap() -> Any:
                    loss = closure()
                    if not done[0]:
                        done[0] = True
                        self.snap(label, step(), hyper=False)
                    return loss

                if "closure" in kwargs:
                    return args, {**kwargs, "closure": then_snap}
                return (args[0], then_snap, *args[2:]), kwargs

            return pre

        self._handles += [register_optimizer_step_pre_hook(hook("Q")), opt.register_step_pre_hook(hook("P"))]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def gather(capture: Capture, world: int, *, classify: bool = True) -> dict[str, Any] | None:
    """Collective: every rank's bytes to every rank; the classes of equal bytes per tensor.

    Returns ``{"classes": {key: {(label, step, rank): class id}}, "points": [(label, step), ...],
    "nbytes": {key: bytes}}``; equal class ids of one key mean equal dtype, shape and bytes. ``classify``
    false: the collectives only (a rank that reports nothing), ``None``."""
    index = [(pt, k, meta, b.numel()) for pt, vals in capture.points for k, (meta, b) in vals.items()]
    flat = [b for _, vals in capture.points for _, b in vals.values()]
    mine = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    indexes: list[Any] = [None] * world
    dist.all_gather_object(indexes, index)
    longest = max(sum(n for *_, n in ix) for ix in indexes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    everyone = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(everyone, padded)
    if not classify:
        return None
    values: dict[Key, list[tuple[tuple[str, int, int], str, torch.Tensor]]] = {}
    points: list[Point] = []
    for r, ix in enumerate(indexes):
        at = 0
        for pt, k, meta, n in ix:
            values.setdefault(k, []).append(((pt[0], pt[1], r), meta, everyone[r][at : at + n]))
            at += n
            if r == 0 and pt not in points:
                points.append(pt)
    classes: dict[Key, dict[tuple[str, int, int], int]] = {}
    nbytes: dict[Key, int] = {}
    for k, vs in values.items():
        # Classes by the bytes themselves (a dict of bytes compares them whole: exact, no digest).
        reps: dict[tuple[str, bytes], int] = {}
        ids: dict[tuple[str, int, int], int] = {}
        for where, meta, b in vs:
            ids[where] = reps.setdefault((meta, b.numpy().tobytes()), len(reps))
        classes[k] = ids
        nbytes[k] = max(b.numel() for _, _, b in vs)
    return {"classes": classes, "points": points, "nbytes": nbytes}
