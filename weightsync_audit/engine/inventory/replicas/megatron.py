"""Megatron-core: which ranks hold each tensor, read from ``megatron.core.parallel_state``.

Megatron never says on a tensor which ranks hold a copy of it; its groups and its parameters' attributes
do, and this adapter reads both (Megatron itself is never imported here: the state is read only when the
user's program imported it and called ``initialize_model_parallel``):

================================  ==================================================================
a tensor-parallel shard           ``param.tensor_model_parallel``: compared among its data-parallel
                                  group with context parallel (same tp and pp coordinate)
a tensor-parallel duplicate       no such attribute (LayerNorm, a row-parallel bias): every rank of its
                                  pipeline stage holds it (tensor x data x context group)
an expert parameter               ``param.allreduce == False``: its expert-data-parallel group
buffers                           the data-parallel group with context parallel
hyper-parameters                  every rank of the pipeline stage, as a duplicate
fp32 main params (distributed     one owner each: counted in the record's note, never compared
optimizer), a reduce-scattered
``main_grad``
================================  ==================================================================

Each group is as strict as DDP replicas: a member lacking a tensor its group holds (a replica built with
another ``add_bias_linear``) is a ``structure`` mismatch. A tensor whose group is this rank alone (a
tensor-parallel shard without data parallelism) is never compared nor counted in ``checked``; the record's
note counts it (as a :data:`TP_SHARD`, or by its group's label).

With pipeline stages every name gets ``stage<i>.`` first (each stage numbers its layers from 0). The
adapter is on when the module carries Megatron's attributes or classes, or was declared with
:func:`declare_megatron`; a plain module audited in a Megatron job stays on the plain path.

>>> import torch
>>> declare_megatron(torch.nn.Linear(2, 2)).weight.shape
torch.Size([2, 2])
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from weightsync_audit.engine.inventory.manifest import Entry, wrapper_of
from weightsync_audit.engine.inventory.peers import ShardInfo, alone, among
from weightsync_audit.engine.inventory.replicas.engines import Rules

_KEEP = (-1,)
_DECLARED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
MAIN_PARAM_SHARD = "Megatron distributed-optimizer main-param shard"
GRAD_SHARD = "Megatron grad-buffer shard (reduce-scattered main_grad)"
TP_SHARD = "Megatron tensor-parallel shard"
"""What a tensor-parallel shard is called in the record's note when its data-parallel group is this rank alone."""
TP_DUPLICATE = "Megatron tensor-parallel duplicate"
EXPERT = "Megatron expert"
DATA_PARALLEL = "Megatron data-parallel"


@dataclass(frozen=True)
class MegatronLayout:
    """This rank's Megatron groups (global ranks, sorted) and coordinates."""

    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    """This rank's coordinate on each dimension (``dp`` without context parallel)."""
    sizes: dict[str, int]
    """World size of each dimension: ``tp``, ``pp``, ``cp``, ``dp``, ``ep``."""
    groups: dict[str, tuple[int, ...]]
    """``data_parallel``, ``data_parallel_with_cp``, ``tensor``, ``pipeline``, ``context``, ``stage``
    (tensor x data x context: the ranks of this pipeline stage), ``expert_data_parallel``,
    ``expert_model_parallel``."""


def declare_megatron(module: nn.Module) -> nn.Module:
    """Audit ``module`` with Megatron's replica groups even if nothing on it looks like Megatron's."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    _DECLARED.add(module)
    return module


def _parallel_state() -> Any:
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not dist.is_initialized():
        return None
    try:
        return ps if ps.model_parallel_is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-torn-down state reads as none
        return None


def _ranks(group: Any) -> tuple[int, ...]:
    if group is None:
        return (dist.get_rank(),)
    return tuple(sorted(dist.get_process_group_ranks(group)))


def megatron_groups(ps: Any = None) -> dict[str, Any]:
    """Megatron's process groups this rank belongs to, by the names :class:`MegatronLayout` uses, for
    ``audit(..., group=megatron_groups()["data_parallel"])``. Raises ``RuntimeError`` before
    ``initialize_model_parallel``."""
    if ps is None:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("megatron_groups(): call megatron.core.parallel_state.initialize_model_parallel first")
    edp = getattr(ps, "get_expert_data_parallel_group", None) or ps.get_data_modulo_expert_parallel_group
    return {
        "data_parallel": ps.get_data_parallel_group(),
        "data_parallel_with_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "tensor": ps.get_tensor_model_parallel_group(),
        "pipeline": ps.get_pipeline_model_parallel_group(),
        "context": ps.get_context_parallel_group(),
        "stage": ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        "expert_data_parallel": edp(),
        "expert_model_parallel": ps.get_expert_model_parallel_group(),
    }


def megatron_layout() -> MegatronLayout | None:
    """This rank's layout from ``megatron.core.parallel_state``, or ``None`` when it is not initialised."""
    ps = _parallel_state()
    if ps is None:
        return None
    groups = {name: _ranks(group) for name, group in megatron_groups(ps).items()}
    sizes = {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
    }
    return MegatronLayout(
        tp=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        cp=ps.get_context_parallel_rank(),
        dp=ps.get_data_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
        sizes=sizes,
        groups=groups,
    )


def _looks_megatron(modules: Sequence[nn.Module | None], params: dict[str, Any]) -> bool:
    if any(m is not None and m in _DECLARED for m in modules):
        return True
    if any(hasattr(p, "tensor_model_parallel") or hasattr(p, "allreduce") for p in params.values()):
        return True
    user = modules[-1]
    return user is not None and any(type(m).__module__.startswith("megatron.") for m in user.modules())


def _is_type(obj: Any, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("megatron.") for c in type(obj).__mro__)


def megatron_rules(
    rules: Rules,
    module: nn.Module | None,
    user: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    include: Sequence[str],
) -> str | None:
    """Fill ``rules`` for a Megatron-laid-out model; the layout's name, or ``None`` (not Megatron's)."""
    if _parallel_state() is None:
        return None
    params = rules.params_by_name
    if not _looks_megatron((module, user), params):
        return None
    layout = megatron_layout()
    if layout is None:
        return None
    g, where = layout.groups, {"tp": layout.tp, "pp": layout.pp}
    # Megatron's groups are as strict as DDP replicas: every member must hold each tensor its group holds
    # (declared), so a replica built without some tensors (a config drift) is a structure difference.
    dense = among(DATA_PARALLEL, g["data_parallel_with_cp"], where, _KEEP, declared=True)
    shard = among(TP_SHARD, g["data_parallel_with_cp"], where, _KEEP, declared=True)
    duplicate = among(TP_DUPLICATE, g["stage"], {"pp": layout.pp}, _KEEP, declared=True)
    expert = among(EXPERT, g["expert_data_parallel"], {"ep": layout.ep, "pp": layout.pp}, _KEEP, declared=True)

    def rule_of(p: Any) -> ShardInfo:
        if not getattr(p, "allreduce", True):
            return expert
        return shard if getattr(p, "tensor_model_parallel", False) else duplicate

    # Hyper-parameters (and anything else without its own rule) are the same on every rank of the stage, as
    # its LayerNorms are; buffers belong to a model replica (its data-parallel group).
    rules.default, rules.buffers = duplicate, dense
    for p in params.values():
        rules.params[id(p)] = rule_of(p)
    wrappers = [wrapper_of(opt) for opt in optimizers]
    sharded = any(_is_type(w, "DistributedOptimizer") for w in wrappers)
    for opt, w in zip(optimizers, wrappers):
        if _is_type(w, "DistributedOptimizer"):
            for group in opt.param_groups:  # this rank's fp32 shards of the main params: one owner each
                for p in group["params"]:
                    rules.params[id(p)] = alone(MAIN_PARAM_SHARD, tuple(p.shape))
        for mains, models in zip(
            getattr(w, "fp32_from_float16_groups", ()) or (), getattr(w, "float16_groups", ()) or ()
        ):
            for main, model_param in zip(mains, models):  # whole fp32 copies: held as their model param is
                rules.params[id(main)] = rule_of(model_param)
    if "grads" in include:
        for name, p in params.items():
            g_ = getattr(p, "main_grad", None)
            if isinstance(g_, torch.Tensor):
                shape = tuple(g_.shape)
                e = Entry(f"{name}.main_grad", "grad", g_, str(g_.dtype).removeprefix("torch."), shape)
                e.shard = alone(GRAD_SHARD, shape) if sharded else rule_of(p)
                rules.extra.append(e)
    if layout.sizes["pp"] > 1:
        rules.prefix = f"stage{layout.pp}."
    sizes = ", ".join(f"{k}={v}" for k, v in layout.sizes.items())
    return f"Megatron-core ({sizes})"
