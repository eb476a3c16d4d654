"""What each framework exposes of the state a resume must restore, as :class:`ResumeSources`.

- Lightning: the lr schedulers of ``trainer.lr_scheduler_configs``, the precision plugin's grad scaler,
  the fit loop's position (``global_step``, and the ``epoch`` and ``batch`` of the next batch it trains, as
  Lightning resumes it) and this process's RNG states. Lightning
  does not restore RNG states: a run that re-seeds at start gets a note; one that restores them per rank
  in its ``on_load_checkpoint`` is checked rank by rank, as they stand right after it (the callback's
  ``on_load_checkpoint``; Lightning draws from the generator before ``on_train_start``).
- Hugging Face Trainer: the lr scheduler, the ``TrainerState`` position (``global_step``, ``epoch``; with
  ``ignore_data_skip`` a resume starts its epoch's data from the first batch, so its position is the
  epoch's start) and the RNG states: at a save the live ones (the Trainer has just written them to
  ``rng_state_{rank}.pth``), at a resume the file this rank will load after ``on_train_begin``.

No framework is imported here: these read attributes of the objects handed in.

>>> class Args: world_size, process_index, ignore_data_skip = 2, 1, True
>>> class State: global_step, epoch = 2, 0.5
>>> hf_resume("loaded", "/ckpt/checkpoint-2", Args(), State(), None).data_position
{'step': 2, 'epoch': 0}
"""

from __future__ import annotations

import math
import os
from typing import Any

from weightsync_audit.compat_engines import lightning_next_batch
from weightsync_audit.engine.checkpoints.resume_state import ResumeSources

__all__ = ["hf_resume", "lightning_resume"]


def lightning_resume(trainer: Any, rng_state: Any = None, resumed: bool = False) -> ResumeSources:
    """The resume state of a Lightning ``Trainer`` on this rank, at a save or right after a restore
    (``resumed``); ``rng_state``: the RNG as the callback's ``on_load_checkpoint`` found it (after the
    module's own ``on_load_checkpoint`` restored it).

    The data position is the next batch the fit loop trains (``epoch``, and ``batch``: its index in that
    epoch's pass over the data), as Lightning will resume it (:func:`~weightsync_audit.compat_engines.
    lightning_next_batch`): an end-of-epoch checkpoint resumes at the next epoch's first batch; one saved
    mid-epoch with a plain ``DataLoader`` starts that epoch's data over (the cause is said with the finding).
    """
    configs = getattr(trainer, "lr_scheduler_configs", None) or []
    plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    position: dict[str, int] = {"step": int(trainer.global_step), "epoch": int(trainer.current_epoch)}
    causes: dict[str, str] = {}
    nxt = lightning_next_batch(trainer, resumed)
    if nxt is not None:
        position.update(epoch=int(nxt[0]), batch=int(nxt[1]))
        if nxt[2]:
            causes["data.position"] = nxt[2]
    return ResumeSources(
        lr_schedulers=[c.scheduler for c in configs if hasattr(c.scheduler, "state_dict")],
        grad_scaler=getattr(plugin, "scaler", None),
        data_position=position,
        rng_state=rng_state,
        causes=causes,
    )


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
