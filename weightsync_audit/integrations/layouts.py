"""Model-parallel layouts read into the audit's peer sets: Megatron-core's groups and torchtitan's meshes.

Megatron-core, nothing to pass by hand: once ``parallel_state.initialize_model_parallel`` ran, ``audit``, ``Auditor`` and
the callbacks read Megatron's groups (data-parallel with and without context parallel, expert
data-parallel, pipeline, tensor) and compare each tensor among its holders
(:mod:`weightsync_audit.engine.inventory.replicas.megatron` says which). This module adds what a Megatron
user reaches for: the layout as the audit reads it, Megatron's groups by name for an audit over one of
them, and :func:`declare_megatron` for a module that carries none of Megatron's marks. It imports
Megatron only when called (``pip install weightsync-audit[megatron]``).

torchtitan lays a job out with ``ParallelDims`` (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``pp``,
``ep``) and builds one device mesh per dimension. Under FSDP2, HSDP, TP and expert parallelism its
parameters are DTensors, which the audit already compares among their own peers; what no tensor says is
which ranks hold the same pipeline stage. :func:`torchtitan_peer_sets` reads every enabled dimension's
ranks (and the stage's), and :func:`declare_torchtitan` declares a model part's stage from them, so a
world-wide audit of a torchtitan job compares each tensor among the ranks that must hold it. torchtitan
is imported only by the caller (``pip install --no-deps torchtitan`` plus ``spmd_types``, ``tyro``: see
docs/torchtitan.md).

>>> megatron_layout() is None  # no initialize_model_parallel in this process
True
>>> torchtitan_peer_sets(None)
{}
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from weightsync_audit.engine.inventory.replicas.declared import declare_replicas
from weightsync_audit.engine.inventory.replicas.megatron import (
    GRAD_SHARD,
    MAIN_PARAM_SHARD,
    TP_SHARD,
    MegatronLayout,
    declare_megatron,
    megatron_groups,
    megatron_layout,
)

__all__ = [
    "GRAD_SHARD", "MAIN_PARAM_SHARD", "TP_SHARD", "MegatronLayout", "declare_megatron", "declare_torchtitan",
    "megatron_groups", "megatron_layout", "torchtitan_peer_sets",
]  # fmt: skip


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
