"""DeepSpeed ZeRO 0-3: which of a rank's tensors are replicas, which are its own partition.

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
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from weightsync_audit.compat_engines import (
    MASTER_CHECK,
    deepspeed_engine_of,
    fp32_master_matches,
    zero3_param_status,
    zero_stage,
)
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.engine.inventory.replicas.keys import alone
from weightsync_audit.engine.inventory.replicas.rules import Rules, named_params
from weightsync_audit.engine.inventory.wrappers import unwrap_optimizer, wrapper_of

__all__ = ["MASTER_CHECK", "deepspeed_rules"]


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
    first = next(iter(user.parameters()), None) if user is not None else None
    stages = [zero_stage(wrapper_of(opt)) for opt in optimizers]
    if (first is None or zero3_param_status(first) is None) and all(s is None for s in stages):
        return None  # not DeepSpeed's: no walk over the parameters
    params = list(named_params(user).values())
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
