"""What the Hugging Face Trainer trains with, read from its arguments and Accelerate's state: the engine
(:func:`engine_of`) and so whether buffers are overwritten from rank 0 at every forward
(:func:`buffer_policy`). It imports neither ``transformers`` nor Accelerate at import time.

>>> from types import SimpleNamespace
>>> engine_of(SimpleNamespace(world_size=1))
"""

from __future__ import annotations

from typing import Any

__all__ = ["buffer_policy", "engine_of", "sharded_reason"]


def engine_of(args: Any) -> str | None:
    """What the Trainer trains with: ``"deepspeed"``, ``"fsdp"``, ``"ddp"`` or ``None`` (one process).

    Read from Accelerate's state first (``accelerate launch`` with a DeepSpeed or FSDP config sets it and
    leaves ``args.deepspeed``/``args.fsdp`` unset; ``fsdp="full_shard"`` on CPU silently trains plain
    DDP), from ``args`` only when Accelerate has no state yet.
    """
    try:
        from accelerate.state import AcceleratorState, is_initialized

        if is_initialized():
            kind = str(getattr(AcceleratorState().distributed_type, "value", "")).upper()
            if "DEEPSPEED" in kind:
                return "deepspeed"
            if "FSDP" in kind:
                return "fsdp"
            return "ddp" if getattr(args, "world_size", 1) > 1 else None
    except ImportError:  # pragma: no cover - accelerate is a dependency of the Trainer
        pass
    if getattr(args, "deepspeed", None):
        return "deepspeed"
    if getattr(args, "fsdp", None):
        return "fsdp"
    return "ddp" if getattr(args, "world_size", 1) > 1 else None


def sharded_reason(args: Any) -> str | None:
    """Kept for callers: no engine the Trainer runs is refused any more (DeepSpeed and FSDP are audited
    through their replica adapters, see docs/sharded.md), so this is always ``None``."""
    return None


def buffer_policy(args: Any) -> bool | None:
    """Whether the Trainer's engine overwrites buffers from rank 0 at every forward (``None``: no engine).

    Only DDP does (``args.ddp_broadcast_buffers``, ``None`` is DDP's default, on); DeepSpeed broadcasts
    buffers at initialisation only and FSDP not at all, so their buffers are compared.
    """
    engine = engine_of(args)
    if engine is None:
        return None
    if engine != "ddp":
        return False
    value = getattr(args, "ddp_broadcast_buffers", None)
    return True if value is None else bool(value)
