"""Replica groups the user names: pipeline stages and expert-parallel groups.

Nothing in a stage's module says which stage it is, nor in an expert which ranks hold the same
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
"""

from __future__ import annotations

import fnmatch
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.distributed as dist
from torch import nn

from weightsync_audit.compat_engines import pipeline_stage_index, pipeline_stage_of
from weightsync_audit.engine.inventory.peers import among, stage_found
from weightsync_audit.engine.inventory.replicas.engines import Rules

__all__ = [
    "Declared",
    "declare_replicas",
    "declare_torchtitan",
    "declared_for",
    "declared_rules",
    "stage_module",
    "torchtitan_peer_sets",
]

_KEEP = (-1,)


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
    return module


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
