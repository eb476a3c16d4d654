"""Megatron-core's parallel state for one block, as the Megatron tests lay out their 4 gloo ranks."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


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
