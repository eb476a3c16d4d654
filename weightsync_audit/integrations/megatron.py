"""Megatron-core: audit a Megatron-laid-out model among the ranks that must hold each tensor.

Nothing to pass by hand: once ``parallel_state.initialize_model_parallel`` ran, ``audit``, ``Auditor`` and
the callbacks read Megatron's groups (data-parallel with and without context parallel, expert
data-parallel, pipeline, tensor) and compare each tensor among its holders
(:mod:`weightsync_audit.engine.inventory.replicas.megatron` says which). This module adds what a Megatron
user reaches for: the layout as the audit reads it, Megatron's groups by name for an audit over one of
them, and :func:`declare_megatron` for a module that carries none of Megatron's marks. It imports
Megatron only when called (``pip install weightsync-audit[megatron]``).

>>> megatron_layout() is None  # no initialize_model_parallel in this process
True
"""

from __future__ import annotations

from typing import Any

from weightsync_audit.engine.inventory.replicas.megatron import (
    GRAD_SHARD,
    MAIN_PARAM_SHARD,
    TP_SHARD,
    MegatronLayout,
    declare_megatron,
    megatron_layout,
)  # fmt: skip

__all__ = [
    "GRAD_SHARD", "MAIN_PARAM_SHARD", "TP_SHARD", "MegatronLayout", "declare_megatron", "megatron_groups", "megatron_layout",
]  # fmt: skip


def megatron_groups() -> dict[str, Any]:
    """Megatron's process groups this rank belongs to, by the names :class:`MegatronLayout` uses, for
    ``audit(..., group=megatron_groups()["data_parallel"])``. Raises ``RuntimeError`` before
    ``initialize_model_parallel``."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron_groups(): call megatron.core.parallel_state.initialize_model_parallel first")
    return {
        "data_parallel": ps.get_data_parallel_group(),
        "data_parallel_with_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "tensor": ps.get_tensor_model_parallel_group(),
        "pipeline": ps.get_pipeline_model_parallel_group(),
        "context": ps.get_context_parallel_group(),
        "stage": ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        "expert_data_parallel": ps.get_expert_data_parallel_group(),
        "expert_model_parallel": ps.get_expert_model_parallel_group(),
    }
