"""Which checkpoint folder the Hugging Face Trainer resumes from, seen from a callback's ``on_train_begin``.

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
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["checkpoint_dir", "resumed_folder"]

_MISSING = object()


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
    given = _train_argument(trainer, depth) if trainer is not None else _MISSING
    if isinstance(given, (str, os.PathLike)) and os.path.isdir(given):
        return os.fspath(given)
    given = getattr(args, "resume_from_checkpoint", None)
    if isinstance(given, (str, os.PathLike)) and os.path.isdir(given):
        return os.fspath(given)
    return checkpoint_dir(args, state)
