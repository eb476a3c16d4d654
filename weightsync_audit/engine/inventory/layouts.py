"""Replica layouts that a model's own tensors do not tell: the ones the user declares and Megatron's.

Both fill the replica table (:class:`Rules`) that :mod:`~weightsync_audit.engine.inventory.replicas` applies.

**Declared** (:func:`declare_replicas`). Nothing in a stage's module says which stage it is, nor in an expert which ranks hold the same
experts, so these are declared once, on the module, with :func:`declare_replicas`:

- a pipeline stage: ``stage=`` its index (or the ``torch.distributed.pipelining`` stage object) and
  ``stage_group=`` the process group of the ranks that hold the same stage (its data-parallel group);
  or ``mesh=`` a DeviceMesh with a ``pp`` dimension (the ranks sharing this rank's ``pp`` coordinate hold
  the same stage). Every tensor of the module is then compared within that group only, named
  ``stage<i>.<name>`` (stages' own names collide); the world-wide audit needs no ``group=``.
- experts: ``experts=`` a glob pattern or a predicate over names, and ``expert_group=`` the process group
  of the ranks holding the same experts (their expert-data-parallel group), or ``mesh=`` with an ``ep``
  dimension (the ranks sharing this rank's ``ep`` coordinate hold the same experts).
- a torchtitan job (``ParallelDims``): its DTensors carry their own peers; what no tensor says is which ranks
  hold the same pipeline stage. :func:`torchtitan_peer_sets` reads every enabled dimension's ranks (and the
  stage's) and :func:`declare_torchtitan` declares a model part's stage from them (docs/torchtitan.md).

>>> import torch
>>> model = declare_replicas(torch.nn.Linear(2, 2), experts="experts.*", expert_group=None)
>>> declared_for(model).experts("experts.0.weight")
True

**Megatron-core** (:func:`megatron_rules`). Megatron never says on a tensor which ranks hold a copy of it; its groups and its parameters' attributes
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

import fnmatch
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from weightsync_audit.compat_engines import pipeline_stage_index, pipeline_stage_of
from weightsync_audit.engine.inventory.manifest import Entry, wrapper_of
from weightsync_audit.engine.inventory.peers import ShardInfo, alone, among, stage_found

__all__ = [
    "DATA_PARALLEL",
    "EXPERT",
    "GRAD_SHARD",
    "MAIN_PARAM_SHARD",
    "TP_DUPLICATE",
    "TP_SHARD",
    "Declared",
    "MegatronLayout",
    "Rules",
    "declare_megatron",
    "declare_replicas",
    "declare_torchtitan",
    "declarations",
    "declared_for",
    "declared_rules",
    "megatron_groups",
    "megatron_layout",
    "megatron_rules",
    "stage_module",
    "torchtitan_peer_sets",
]

_KEEP = (-1,)


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


@dataclass(frozen=True)
class Declared:
    """What :func:`declare_replicas` recorded for one module."""

    stage: int | None
    stage_ranks: tuple[int, ...] | None
    experts: Callable[[str], bool] | None
    expert_ranks: tuple[int, ...] | None
    expert_coord: int
    stages: int | None = None
    """For a stage handed to the audit undeclared (a ``PipelineStage`` or its schedule): the number of
    stages; its replicas are then the ranks of the same stage, found by the audit, and names stay global."""


_DECLARED: weakref.WeakKeyDictionary[nn.Module, Declared] = weakref.WeakKeyDictionary()
_MADE = [0]  # declarations made in this process (a manifest cached before the last one is stale)


def _ranks(group: Any) -> tuple[int, ...] | None:
    if group is None or not dist.is_initialized():
        return None
    return tuple(sorted(dist.get_process_group_ranks(group)))


def _mesh_ranks(mesh: Any, dim: str) -> tuple[tuple[int, ...], int] | None:
    """The global ranks sharing this rank's coordinate on mesh dimension ``dim``, and that coordinate."""
    names = tuple(mesh.mesh_dim_names or ())
    if dim not in names:
        return None
    d = names.index(dim)
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    grid = mesh.mesh
    same = grid.select(d, coord[d]) if grid.dim() > 1 else grid[coord[d] : coord[d] + 1]
    return tuple(sorted(int(r) for r in same.flatten().tolist())), int(coord[d])


def declare_replicas(
    module: nn.Module,
    *,
    stage: Any = None,
    stage_group: Any = None,
    experts: str | Callable[[str], bool] | None = None,
    expert_group: Any = None,
    mesh: Any = None,
    pp_dim: str = "pp",
    ep_dim: str = "ep",
    stage_ranks: Sequence[int] | None = None,
) -> nn.Module:
    """Name the replica groups of a pipeline stage and/or of expert parameters on ``module``; returns it.

    See the module docstring; ``module`` is what is then passed to ``audit``/``Auditor``/a callback.
    ``stage_ranks``: the global ranks holding the same stage, in place of ``stage_group`` (when the
    framework knows them but made no process group of exactly them, as torchtitan's meshes)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    index = stage if isinstance(stage, int) or stage is None else pipeline_stage_index(stage)
    if stage is not None and index is None:
        raise TypeError(f"stage={stage!r}: give the stage's index or its torch.distributed.pipelining stage")
    stage_ranks = tuple(sorted(int(r) for r in stage_ranks)) if stage_ranks is not None else _ranks(stage_group)
    if mesh is not None and (found := _mesh_ranks(mesh, pp_dim)) is not None:
        stage_ranks, index = found[0], found[1] if index is None else index
    if index is not None and stage_ranks is None and dist.is_initialized():
        raise ValueError("stage= needs stage_group= (the ranks holding the same stage) or mesh= with a 'pp' dim")
    if isinstance(experts, str):
        pattern = experts
        experts = lambda name: fnmatch.fnmatchcase(name, pattern)  # noqa: E731
    if experts is not None and not callable(experts):
        raise TypeError("experts= must be a glob pattern or a predicate over parameter names")
    expert_ranks, coord = _ranks(expert_group), 0
    if mesh is not None and experts is not None and (found := _mesh_ranks(mesh, ep_dim)) is not None:
        expert_ranks, coord = found
    if expert_ranks is not None and expert_group is not None:
        coord = min(expert_ranks)
    _DECLARED[module] = Declared(index, stage_ranks, experts, expert_ranks, coord)
    _MADE[0] += 1
    return module


def stage_module(obj: Any) -> Any:
    """``obj`` itself, or for a ``torch.distributed.pipelining`` ``PipelineStage`` or single-stage schedule
    its stage module, remembered as that stage (no declaration needed: the ranks of the same stage are
    found by the audit, and the stage module keeps its own names, torchtitan's global ones included)."""
    if isinstance(obj, nn.Module) or obj is None:
        return obj
    found = pipeline_stage_of(obj)
    if found is None:
        return obj
    module, index, stages = found
    if module not in _DECLARED:  # a declaration made by the user wins
        _DECLARED[module] = Declared(index, None, None, None, 0, stages)
        _MADE[0] += 1
    return module


def declarations() -> int:
    return _MADE[0]  # how many declarations this process made so far: part of a cached manifest's key


def declared_for(module: nn.Module | None) -> Declared | None:
    """What was declared on ``module`` (or the module it wraps), else ``None``."""
    return _DECLARED.get(module) if module is not None else None


def declared_rules(rules: Rules, *modules: nn.Module | None) -> str | None:
    """Fill ``rules`` from a declaration on any of ``modules`` (wrapper first, then the user's module)."""
    found = next((d for m in modules if (d := declared_for(m)) is not None), None)
    if found is None:
        return None
    what = []
    if found.stage is not None and found.stage_ranks is None and found.stages is not None:
        rules.default, rules.stage = stage_found(found.stage, found.stages, _KEEP), found.stage
        what.append(f"pipeline stage {found.stage}")
    if found.stage is not None and found.stage_ranks is not None:
        rules.default = among("pipeline stage", found.stage_ranks, {"stage": found.stage}, _KEEP, declared=True)
        rules.prefix, rules.stage = f"stage{found.stage}.", found.stage
        what.append(f"pipeline stage {found.stage}")
    if found.experts is not None and found.expert_ranks is not None:
        info = among("expert", found.expert_ranks, {"experts": found.expert_coord}, _KEEP, declared=True)
        test = found.experts
        rules.by_name = lambda name: info if test(name) else None
        what.append("expert groups")
    return ", ".join(what) or None


def torchtitan_peer_sets(parallel_dims: Any) -> dict[str, tuple[int, ...]]:
    """This rank's group (global ranks, sorted) along every enabled dimension of ``parallel_dims`` (a
    ``torchtitan.distributed.ParallelDims``): the one-dimensional meshes it built (``pp``, ``dp_replicate``,
    ``dp_shard``, ``dp``, ``cp``, ``tp``, ``ep``, ``efsdp``, ``batch``, ``loss``), plus ``stage``: the ranks
    sharing this rank's pipeline coordinate (every rank when ``pp`` is 1). Empty without a process group
    or ``parallel_dims``. Collective the first time (torchtitan builds its meshes then)."""
    if parallel_dims is None or not dist.is_initialized():
        return {}
    meshes = parallel_dims.get_all_one_dimensional_meshes()
    out = {name: tuple(sorted(dist.get_process_group_ranks(m.get_group()))) for name, m in meshes.items()}
    world = int(parallel_dims.world_size)
    per_stage = world // int(parallel_dims.pp)
    first = (dist.get_rank() // per_stage) * per_stage  # torchtitan unflattens the world with pp outermost
    out["stage"] = tuple(range(first, first + per_stage))
    return out


def declare_torchtitan(model_part: nn.Module, parallel_dims: Any) -> nn.Module:
    """Declare ``model_part`` (one of torchtitan's ``model_parts``) as this rank's pipeline stage when
    ``pp`` > 1 (its tensors compared among the ranks of the stage, names prefixed ``stage<i>.``); returns
    it. Without pipeline parallelism there is nothing to declare: DTensors carry their own peers."""
    if int(getattr(parallel_dims, "pp", 1)) <= 1:
        return model_part
    peers = torchtitan_peer_sets(parallel_dims)
    stage = peers["pp"].index(dist.get_rank()) if "pp" in peers else 0
    return declare_replicas(model_part, stage=stage, stage_ranks=peers["stage"])


_MEGATRON_DECLARED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
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
    _MEGATRON_DECLARED.add(module)
    return module


def _parallel_state() -> Any:
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not dist.is_initialized():
        return None
    try:
        return ps if ps.model_parallel_is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-torn-down state reads as none
        return None


def _group_ranks(group: Any) -> tuple[int, ...]:
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
    groups = {name: _group_ranks(group) for name, group in megatron_groups(ps).items()}
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
    if any(m is not None and m in _MEGATRON_DECLARED for m in modules):
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
