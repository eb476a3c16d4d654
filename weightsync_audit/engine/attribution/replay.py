"""The update re-checked: replay a rank's own optimizer step on a pre-step copy, and compare.

Right before the step, :class:`UpdateReplay` copies what the update reads for the parameters it covers
(the parameter, its gradient, its optimizer state, its group's hyperparameters); right after, it runs the
same torch optimizer class on the copies and compares the bytes with what the real step wrote. A rank
whose own update does not reproduce computed it wrong (hardware-suspect); a rank that reproduces its own
result differs, if at all, by what went in (software).

>>> import torch
>>> p = torch.nn.Parameter(torch.ones(3))
>>> opt = torch.optim.Adam([p], lr=0.1)
>>> p.grad = torch.full((3,), 0.5)
>>> replay = UpdateReplay(slices=1)
>>> replay.before(opt, step=0)
>>> opt.step()
>>> replay.after(opt)
[]
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync_audit.engine.hashing.digest import digest_tensors

__all__ = ["UpdateReplay", "torch_class"]


def torch_class(opt: torch.optim.Optimizer) -> type[torch.optim.Optimizer] | None:
    """The torch optimizer class ``opt`` runs (its own, or the torch class a subclass extends)."""
    for cls in type(opt).__mro__:
        if cls.__module__.startswith("torch.optim") and cls is not torch.optim.Optimizer:
            return cls
    return None


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class UpdateReplay:
    """Copies before the step (1 parameter in ``slices``, rotating with the step), replays after it."""

    def __init__(self, slices: int) -> None:
        self.slices = slices
        self.names: dict[int, str] = {}
        """id(parameter) -> its name, for what :meth:`after` returns."""
        self._kept: dict[int, list[tuple[dict[str, Any], list[Any]]]] = {}
        self.covered = 0
        """Parameters replayed at the last step."""

    def before(self, opt: torch.optim.Optimizer, step: int) -> None:
        """Right before ``opt.step()``: copy what the update of the covered parameters reads."""
        groups: list[tuple[dict[str, Any], list[Any]]] = []
        if torch_class(opt) is None:
            self._kept[id(opt)] = groups
            return
        index = 0
        for group in opt.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            kept = []
            for p in group["params"]:
                take = index % self.slices == step % self.slices
                index += 1
                if not take or p.grad is None or p.grad.is_sparse:
                    continue
                state = {k: _copy(v) for k, v in opt.state.get(p, {}).items()}
                kept.append((p, p.detach().clone(), p.grad.detach().clone(), state))
            if kept:
                groups.append((hyper, kept))
        self._kept[id(opt)] = groups

    def after(self, opt: torch.optim.Optimizer) -> list[str]:
        """Right after ``opt.step()``: replay on the copies; the names whose bytes the replay does not give."""
        groups = self._kept.pop(id(opt), [])
        cls = torch_class(opt)
        if not groups or cls is None:
            self.covered = 0
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
        except Exception:  # noqa: BLE001 - a class that cannot be rebuilt from its groups is not replayed
            self.covered = 0
            return []
        for _, copy, state in pairs:
            if state:
                replayed.state[copy] = state
        replayed.step()
        self.covered = len(pairs)
        bad = []
        for real, copy, _ in pairs:
            mine = [real.detach(), *[v for v in opt.state.get(real, {}).values() if isinstance(v, torch.Tensor)]]
            again = [copy.detach(), *[v for v in replayed.state.get(copy, {}).values() if isinstance(v, torch.Tensor)]]
            if len(mine) != len(again) or (digest_tensors(mine) != digest_tensors(again)).any():
                bad.append(self.names.get(id(real), f"param {len(bad)}"))
        return bad
