"""FSDP1 (``FullyShardedDataParallel``): which flat-parameter shards have replicas, and where.

- ``NO_SHARD``: every parameter is a full replica (as under DDP).
- ``FULL_SHARD`` / ``SHARD_GRAD_OP``: each rank holds its own shard of every ``FlatParameter`` (equal
  padded pieces with ``use_orig_params=False``; uneven 1-D views of the original parameters with
  ``True``): *unreplicated*. Buffers and scalars (``step``, hyper-parameters) are compared.
- ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: a shard is replicated across the replicate group
  (``_inter_node_pg``), so it is compared among that group's ranks automatically, named by the shard
  index (``{"shard": i}``); no ``group=`` needed.

Optimizer state of a shard has one owner (its scalars, ``step``, are compared where they exist), so a
rank that lost it (a fresh optimizer, a failed load) would compare nothing: every rank that holds a
non-empty piece of a sharded parameter adds one boolean, ``fsdp1.optimizer_state_held.<name>``, whether
its optimizer holds state for it, compared among those ranks (a rank whose piece is empty holds no state
by design and no such entry).

Names drop FSDP's ``_fsdp_wrapped_module.`` prefixes, so they are the user's own.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from weightsync_audit.compat_engines import (
    STATE_CHECK,
    fsdp1_flat_param,
    fsdp1_modules,
    fsdp1_orig_params,
    fsdp1_orig_shapes,
    fsdp1_replicate_ranks,
    fsdp1_strategy,
)
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.engine.inventory.replicas.keys import alone, among
from weightsync_audit.engine.inventory.replicas.rules import Rules, named_params

__all__ = ["fsdp1_rules", "WRAPPED_PREFIX"]

WRAPPED_PREFIX = "_fsdp_wrapped_module."


def fsdp1_rules(
    rules: Rules,
    root: nn.Module | None,
    names: Sequence[str] = (),
    optimizers: Sequence[torch.optim.Optimizer] = (),
    include: Sequence[str] = (),
) -> str | None:
    """Fill ``rules`` for every FSDP1 instance under ``root``; return ``"FSDP1 <strategy>"`` or ``None``.

    ``names`` (the manifest's): FSDP1 puts ``_fsdp_wrapped_module.`` in every name it holds, so a model
    without it is not walked at all. With ``"optimizer"`` in ``include``, the state checks of ``optimizers``
    are added (see the module docstring)."""
    if root is None or (names and not any(WRAPPED_PREFIX in n for n in names)):
        return None
    found = None
    for _, fsdp in fsdp1_modules(root):
        strategy = fsdp1_strategy(fsdp)
        found = found or f"FSDP1 {strategy}"
        flat = fsdp1_flat_param(fsdp)
        if flat is None or strategy == "NO_SHARD":
            continue
        shapes = fsdp1_orig_shapes(flat)
        held = [(flat, (-1,))] + [
            (p, tuple(shapes[i]) if i < len(shapes) else (-1,)) for i, p in enumerate(fsdp1_orig_params(flat))
        ]
        replicate = fsdp1_replicate_ranks(fsdp) if "HYBRID" in strategy else None
        for p, shape in held:
            shape = shape if shape != (-1,) else ("flat",)  # type: ignore[assignment]
            if replicate is not None and len(replicate) > 1:
                shard = dist.get_rank(getattr(fsdp, "process_group", None))
                rules.params[id(p)] = among("FSDP1 hybrid shard", replicate, {"shard": shard}, _full(p, shape))
            else:
                rules.params[id(p)] = alone("FSDP1 shard", _full(p, shape))
    if found:
        rules.strip = (*rules.strip, WRAPPED_PREFIX)
        if "optimizer" in include:
            _state_checks(rules, root, optimizers)
    return found


_HELD = among("FSDP1 optimizer state held", (), {}, ())
"""Compared among the ranks that hold the check (those with a non-empty piece of the parameter)."""


def _state_checks(rules: Rules, root: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """One ``fsdp1.optimizer_state_held.<name>`` per sharded parameter of ``optimizers`` with a non-empty piece
    here, named as the manifest names the parameter's state."""
    names = {id(p): n for n, p in named_params(root).items()}
    multi = len(optimizers) > 1
    for oi, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in rules.params or p.numel() == 0:
                    continue
                name = names.get(id(p)) or f"{f'optimizers.{oi}.' if multi else ''}param_groups.{gi}.params.{pi}"
                held = torch.tensor(bool(opt.state.get(p)))
                rules.extra.append(Entry(f"{STATE_CHECK}.{name}", "optimizer", held, "bool", (), shard=_HELD))


def _full(p: object, shape: tuple) -> tuple[int, ...]:
    # A flat parameter's shard has the same padded size on every rank of its sharding group; an original
    # parameter's view does not, so it is described by its unsharded shape.
    if shape == ("flat",):
        return tuple(int(s) for s in getattr(p, "shape", ()))
    return tuple(int(s) for s in shape)
