"""The sharding engines whose own state says which of a rank's tensors are replicas: DeepSpeed ZeRO and FSDP1.

**DeepSpeed ZeRO 0-3** (:func:`deepspeed_rules`).

- Module parameters: replicas under ZeRO 0-2 (the compute-dtype copies every rank all-gathers); under
  ZeRO-3 a parameter between steps is a ``Tensor(0,)`` placeholder (``ds_status`` NOT_AVAILABLE) and
  is *unreplicated* (its partition ``ds_tensor`` has one owner), while a gathered or persistent one
  (``ds_persist``, under ``stage3_param_persistence_threshold``) is a replica. No ZeRO-3 parameter is
  ever gathered for the audit: that would cost the whole model on every rank and compare nothing.
- Buffers: replicas (DeepSpeed broadcasts them at initialisation only, so they are compared).
- The inner optimizer: under ZeRO 1-3 (``BF16_Optimizer`` included) its parameters are this rank's fp32
  master partitions, so they and their ``exp_avg``/``exp_avg_sq`` have one owner; its ``step`` and its
  param groups' hyper-parameters are replicas. Under ZeRO-0 in bf16 (``FP16_UnfusedOptimizer``) every rank
  holds the whole fp32 master and its state: all replicas, all compared.
- ZeRO 0-2 (fp32 master beside the compute copies): a local check that the parameters this rank's master
  updates equal its cast, entered as one boolean entry (``zero.fp32_master_matches_params``) that every
  rank compares. A corrupted master partition is otherwise invisible until the next all-gather hands it
  to every rank.

**FSDP1** (``FullyShardedDataParallel``, :func:`fsdp1_rules`).

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

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from weightsync_audit.compat_engines import (
    MASTER_CHECK,
    STATE_CHECK,
    deepspeed_engine_of,
    fp32_master_matches,
    fsdp1_flat_param,
    fsdp1_modules,
    fsdp1_orig_params,
    fsdp1_orig_shapes,
    fsdp1_replicate_ranks,
    fsdp1_strategy,
    zero3_param_status,
    zero_stage,
)
from weightsync_audit.engine.inventory.manifest import Entry, unwrap_optimizer, wrapper_of
from weightsync_audit.engine.inventory.peers import ShardInfo, alone, among

__all__ = ["MASTER_CHECK", "WRAPPED_PREFIX", "Rules", "deepspeed_rules", "fsdp1_rules"]


@dataclass
class Rules:
    """One model's replica decisions, filled by each engine's adapter (empty: every tensor is a replica on
    every rank, as under DDP). A new integration fills one with :func:`~.peers.among` and :func:`~.peers.alone`."""

    params_by_name: dict[str, Any] = field(default_factory=dict)
    """The model's parameters by the name the manifest gives them (first name of a shared one)."""
    params: dict[int, ShardInfo] = field(default_factory=dict)
    """``id(parameter)`` (a module's or an optimizer's) to its rule."""
    default: ShardInfo | None = None
    """The rule of every other entry (``None``: compared on every rank)."""
    buffers: ShardInfo | None = None
    """The rule of buffers when it differs from ``default``."""
    by_name: Callable[[str], ShardInfo | None] | None = None
    """A rule chosen by the entry's (parameter's) name, e.g. expert parameters; wins over ``default``."""
    extra: list[Entry] = field(default_factory=list)
    """Entries added to the manifest (the verdict of a local check)."""
    strip: tuple[str, ...] = ()
    """Wrapper prefixes dropped from names (``_fsdp_wrapped_module.``)."""
    prefix: str = ""
    """Put before every name (a pipeline stage's own names collide with the other stages')."""
    stage: int | None = None
    """A declared pipeline stage's index: its DTensors are compared within the stage only
    (:func:`~.peers.in_stage`), whatever mesh they live on."""

    @property
    def empty(self) -> bool:
        return not (self.params or self.default or self.buffers or self.by_name or self.extra or self.strip)


def deepspeed_rules(
    rules: Rules,
    user: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    include: Sequence[str],
    module: nn.Module | None = None,
) -> str | None:
    """Fill ``rules`` for a DeepSpeed-trained model; return the engine's name (``"DeepSpeed ZeRO-2"``) or
    ``None`` when nothing here is DeepSpeed's.

    ``optimizers`` may hold ``engine.optimizer`` (unwrapped to its torch optimizer, the wrapper
    remembered) or the torch optimizer the user passed to ``deepspeed.initialize``: the engine is then
    found from ``module`` (the engine, or the model it trains) and its wrapper remembered alike."""
    found: str | None = None
    if any(wrapper_of(opt) is None for opt in optimizers):
        engine = next((e for m in (module, user) if (e := deepspeed_engine_of(m)) is not None), None)
        if engine is not None and getattr(engine, "optimizer", None) is not None:
            unwrap_optimizer(engine.optimizer)  # remembers the ZeRO wrapper of the torch optimizer inside it
    # ZeRO-3 converts every parameter of the model it holds: the first one tells, at no per-parameter cost.
    params = list(rules.params_by_name.values())
    stages = [zero_stage(wrapper_of(opt)) for opt in optimizers]
    if (not params or zero3_param_status(params[0]) is None) and all(s is None for s in stages):
        return None  # not DeepSpeed's: no walk over the parameters
    for p in params:
        status = zero3_param_status(p)
        if status is None:
            continue
        found = "DeepSpeed ZeRO-3"
        if status[0] == "placeholder":
            rules.params[id(p)] = alone("ZeRO-3 partitioned parameter", status[1])
    module_params = {id(p) for p in params}
    for opt, stage in zip(optimizers, stages):
        if stage is None:
            continue
        found = f"DeepSpeed ZeRO-{stage}" if stage else "DeepSpeed (bf16/fp16)"
        for group in opt.param_groups if stage else ():  # ZeRO-0: a whole fp32 master on every rank, compared
            for p in group["params"]:
                if id(p) not in module_params:  # an fp32 master partition, not a module parameter
                    rules.params[id(p)] = alone("ZeRO optimizer partition", tuple(p.shape))
        if stage in (0, 1, 2) and "optimizer" in include:
            ok = fp32_master_matches(wrapper_of(opt))
            if ok is not None:
                t = torch.tensor(bool(ok))
                rules.extra.append(Entry(MASTER_CHECK, "optimizer", t, "bool", ()))
    return found


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
        hybrid = replicate is not None and len(replicate) > 1
        shard = dist.get_rank(getattr(fsdp, "process_group", None)) if hybrid else 0
        for p, shape in held:
            # A flat parameter's shard has the same padded size on every rank of its sharding group; an
            # original parameter's view does not, so it is described by its unsharded shape.
            full = tuple(int(s) for s in (p.shape if shape == (-1,) else shape))
            rules.params[id(p)] = (
                among("FSDP1 hybrid shard", replicate or (), {"shard": shard}, full)
                if hybrid
                else alone("FSDP1 shard", full)
            )
    if found:
        rules.strip = (*rules.strip, WRAPPED_PREFIX)
    if found and "optimizer" in include:
        _state_checks(rules, optimizers)
    return found


_HELD = among("FSDP1 optimizer state held", (), {}, ())
"""Compared among the ranks that hold the check (those with a non-empty piece of the parameter)."""


def _state_checks(rules: Rules, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """One ``fsdp1.optimizer_state_held.<name>`` per sharded parameter of ``optimizers`` with a non-empty piece
    here, named as the manifest names the parameter's state."""
    names = {id(p): n for n, p in rules.params_by_name.items()}
    multi = len(optimizers) > 1
    for oi, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in rules.params or p.numel() == 0:
                    continue
                name = names.get(id(p)) or f"{f'optimizers.{oi}.' if multi else ''}param_groups.{gi}.params.{pi}"
                held = torch.tensor(bool(opt.state.get(p)))
                rules.extra.append(Entry(f"{STATE_CHECK}.{name}", "optimizer", held, "bool", (), shard=_HELD))
