"""Megatron-core's parallel state for one block, as the Megatron tests lay out their 4 gloo ranks; a real
GPTModel laid out by it; and which copy of each parameter a rank holds, read from Megatron's own marks."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def model_parallel(tp: int, pp: int, cp: int, ep: int) -> Iterator[None]:
    """``initialize_model_parallel`` with these tensor, pipeline, context and expert parallel sizes for the
    block, ``destroy_model_parallel`` after it (megatron-core is imported here, after the test's importorskip)."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    try:
        yield
    finally:
        ps.destroy_model_parallel()


def gpt_model(add_bias_linear: bool = True) -> Any:
    """A small Megatron ``GPTModel`` (2 layers, hidden 64, local layer spec, built on CPU) laid out as the
    current parallel state says: its tensor-parallel shards, and with pipeline stages this rank's layer and
    the embedding (first stage) or the output layer (last stage) only."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        add_bias_linear=add_bias_linear,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=128,
        max_sequence_length=32,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )


def shard_identities(model: Any) -> dict[str, tuple[Any, ...]]:
    """Which copy of each parameter this rank holds, from Megatron's own coordinates and marks: a tensor-parallel
    shard is its (stage, tp rank); an expert its (stage, ep rank, expert-tp rank); anything else (a duplicate)
    its stage. Names as the audit prints them (``stage<i>.`` under pipeline parallelism)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_rank()
    prefix = f"stage{pp}." if ps.get_pipeline_model_parallel_world_size() > 1 else ""
    out: dict[str, tuple[Any, ...]] = {}
    for name, p in model.named_parameters():
        if not getattr(p, "allreduce", True):
            out[prefix + name] = (
                "expert",
                pp,
                ps.get_expert_model_parallel_rank(),
                ps.get_expert_tensor_parallel_rank(),
            )
        elif getattr(p, "tensor_model_parallel", False):
            out[prefix + name] = ("tp", pp, ps.get_tensor_model_parallel_rank())
        else:
            out[prefix + name] = ("duplicate", pp)
    return out


def replicated(per_rank: list[dict[str, tuple[Any, ...]]]) -> int:
    """How many parameter names have a copy held by two ranks or more (what an audit can compare)."""
    holders: dict[str, dict[tuple[Any, ...], int]] = {}
    for ids in per_rank:
        for name, ident in ids.items():
            holders.setdefault(name, {}).setdefault(ident, 0)
            holders[name][ident] += 1
    return sum(1 for copies in holders.values() if max(copies.values()) > 1)
