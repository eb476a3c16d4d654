"""What the Hugging Face Trainer's arguments and state say: what it trains with, read from its arguments
and Accelerate's state (the engine, :func:`engine_of`, and so whether buffers are overwritten from rank 0
at every forward, :func:`buffer_policy`), and which checkpoint folder it resumes from (:func:`resumed_folder`).
It imports neither ``transformers`` nor Accelerate at import time.

>>> from types import SimpleNamespace
>>> engine_of(SimpleNamespace(world_size=1))

The Trainer keeps the folder given to ``train(resume_from_checkpoint=...)`` (resolved from ``True`` to the
newest ``checkpoint-N`` of ``output_dir``) only as an argument of its training loop; it loads the weights,
optimizer, scheduler and ``trainer_state.json`` from there, and each rank's ``rng_state_{rank}.pth`` after
``on_train_begin``. So the resume check reads that argument from the Trainer's own frame on the stack, the
frame that dispatches the event (no other attribute holds it); ``args.resume_from_checkpoint`` (which the
Trainer itself does not use) and ``<output_dir>/checkpoint-<global_step>`` are the fallbacks when it is not
there (a callback called by hand).

>>> class Args: output_dir, resume_from_checkpoint = "/out", None
>>> class State: global_step = 4
>>> resumed_folder(None, Args(), State())
'/out/checkpoint-4'

What a resume must restore (:func:`hf_resume`): the lr scheduler, the ``TrainerState`` position
(``global_step``, ``epoch``; with ``ignore_data_skip`` a resume starts its epoch's data from the first batch,
so its position is the epoch's start) and the RNG states: at a save the live ones (the Trainer has just written
them to ``rng_state_{rank}.pth``), at a resume the file this rank will load after ``on_train_begin``.

>>> class Args: world_size, process_index, ignore_data_skip = 2, 1, True
>>> class State: global_step, epoch = 2, 0.5
>>> hf_resume("loaded", "/ckpt/checkpoint-2", Args(), State(), None).data_position
{'step': 2, 'epoch': 0}
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

from weightsync_audit.engine.checkpoints.resume_state import ResumeSources

__all__ = ["buffer_policy", "checkpoint_dir", "engine_of", "hf_resume", "resumed_folder"]

_MISSING = object()


def engine_of(args: Any) -> str | None:
    """What the Trainer trains with: ``"deepspeed"``, ``"fsdp"``, ``"ddp"`` or ``None`` (one process).

    Read from Accelerate's state first (``accelerate launch`` with a DeepSpeed or FSDP config sets it and
    leaves ``args.deepspeed``/``args.fsdp`` unset; ``fsdp="full_shard"`` on CPU silently trains plain
    DDP), from ``args`` only when Accelerate has no state yet.
    """
    kind = None
    try:
        from accelerate.state import AcceleratorState, is_initialized

        if is_initialized():
            kind = str(getattr(AcceleratorState().distributed_type, "value", "")).upper()
    except ImportError:  # pragma: no cover - accelerate is a dependency of the Trainer
        pass
    if kind is None:  # no Accelerate state yet: the arguments say
        kind = "DEEPSPEED" if getattr(args, "deepspeed", None) else "FSDP" if getattr(args, "fsdp", None) else ""
    if "DEEPSPEED" in kind:
        return "deepspeed"
    if "FSDP" in kind:
        return "fsdp"
    return "ddp" if getattr(args, "world_size", 1) > 1 else None


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


def checkpoint_dir(args: Any, state: Any) -> str:
    """The folder the Trainer saves the checkpoint of this step in: ``<output_dir>/checkpoint-<global_step>``."""
    return os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")


def _train_argument(trainer: Any, depth: int) -> Any:
    """``resume_from_checkpoint`` in the frame of ``trainer``'s training loop up the stack, or ``_MISSING``."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            break
        local = frame.f_locals
        if local.get("self") is trainer and "resume_from_checkpoint" in local:
            return local["resume_from_checkpoint"]
        frame = frame.f_back  # type: ignore[assignment]
    return _MISSING


def resumed_folder(trainer: Any, args: Any, state: Any, depth: int = 12) -> str | None:
    """The folder ``trainer`` resumes from (``None``: not resuming, ``state.global_step == 0``)."""
    if not state.global_step:
        return None
    passed = _train_argument(trainer, depth) if trainer is not None else _MISSING
    for given in (passed, getattr(args, "resume_from_checkpoint", None)):  # train()'s argument, then args'
        if isinstance(given, (str, os.PathLike)) and os.path.isdir(given):
            return os.fspath(given)
    return checkpoint_dir(args, state)


def hf_resume(event: str, path: str, args: Any, state: Any, lr_scheduler: Any) -> ResumeSources:
    """The resume state of the Hugging Face Trainer on this rank at a save or a resume (``event``)."""
    epoch = round(float(state.epoch or 0), 6)
    if event == "loaded" and getattr(args, "ignore_data_skip", False):
        epoch = math.floor(epoch)  # the resumed epoch's data starts over from its first batch
    rng_file = None
    if event == "loaded":
        name = f"rng_state_{args.process_index}.pth" if int(args.world_size) > 1 else "rng_state.pth"
        candidate = os.path.join(str(path), name)
        rng_file = candidate if os.path.isfile(candidate) else None  # none: the Trainer restores nothing
    return ResumeSources(
        rng_file=rng_file,
        lr_schedulers=[lr_scheduler] if lr_scheduler is not None and hasattr(lr_scheduler, "state_dict") else [],
        data_position={"step": int(state.global_step), "epoch": epoch},
    )
