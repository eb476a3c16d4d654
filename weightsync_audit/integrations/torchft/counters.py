"""Step counters and declared state that must be equal on every replica, compared through the roll.

After a heal the parameters and the optimizer state are tensors, audited by the engine like any others.
What a healed replica also needs is the same *position* in training: the Manager's step and committed
batches, the lr scheduler's state (``last_epoch``, ``_step_count``, its base and last lrs), and whatever
else the user declares with ``must_match`` (an EMA's step, a curriculum's stage). These are a few small
values: each member carries them in its roll entry, so every member compares the same gathered values with
the library's vote (:func:`~weightsync_audit.text.majority`) and names a value that differs as a mismatch
(kind ``optimizer`` for the Manager's and the scheduler's counters, ``buffer`` for declared state).

>>> values = [{"lr_scheduler.last_epoch": ["optimizer", 5]}, {"lr_scheduler.last_epoch": ["optimizer", 0]}]
>>> [(m.name, m.ranks, m.detail) for m in compare(values, (0, 1))[0]]
[('lr_scheduler.last_epoch', [1], 'rank 1 holds 0, rank 0 holds 5')]
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Mapping, Sequence

import torch

from weightsync_audit.engine.hashing.digest import digest_tensor
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import majority

__all__ = ["collect", "compare"]


def _plain(value: Any) -> Any:
    """``value`` as JSON (a tensor by its dtype, shape and exact digest); ``None`` when it cannot be."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "digest": digest_tensor(t)}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if isinstance(value, Mapping):
        out = {str(k): _plain(v) for k, v in value.items()}
        return None if any(out[str(k)] is None and v is not None for k, v in value.items()) else out
    return None


def collect(
    manager: Any, lr_scheduler: Any = None, must_match: Mapping[str, Callable[[], Any]] | None = None
) -> tuple[dict[str, list[Any]], list[str]]:
    """This replica's counters, name -> ``[kind, JSON value]``, and the names it could not express."""
    out: dict[str, list[Any]] = {
        "torchft.manager.step": ["optimizer", int(manager.current_step())],
        "torchft.manager.batches_committed": ["optimizer", int(manager.batches_committed())],
    }
    skipped: list[str] = []
    schedulers = lr_scheduler if isinstance(lr_scheduler, (list, tuple)) else [lr_scheduler] if lr_scheduler else []
    for i, sched in enumerate(schedulers):
        prefix = "lr_scheduler" if len(schedulers) == 1 else f"lr_scheduler.{i}"
        for key, value in sorted(sched.state_dict().items()):
            plain = _plain(value)
            if plain is None and value is not None:
                skipped.append(f"{prefix}.{key}")  # a closure (LambdaLR's lr_lambdas): not comparable
            else:
                out[f"{prefix}.{key}"] = ["optimizer", plain]
    for name, read in (must_match or {}).items():
        value = read()
        plain = _plain(value)
        if plain is None and value is not None:
            raise TypeError(
                f"must_match[{name!r}] returned a {type(value).__name__}: give numbers, strings, tensors, "
                "or lists and dicts of them"
            )
        out[name] = ["buffer", plain]
    return out, skipped


def _gap(values: Sequence[Any], ref: Any) -> float | None:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(nums) != len(values) or not isinstance(ref, (int, float)) or isinstance(ref, bool):
        return None
    return float(max(abs(v - ref) for v in nums))


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def compare(per_member: Sequence[Mapping[str, list[Any]]], ranks: Sequence[int]) -> tuple[list[Mismatch], int]:
    """The counters that differ among the members (``ranks``: their replica ranks, in position order), and
    how many were compared. A counter some members lack is a ``structure`` mismatch naming them."""
    names = sorted({n for values in per_member for n in values})
    mismatches: list[Mismatch] = []
    for name in names:
        holders = [i for i, values in enumerate(per_member) if name in values]
        kind = next(per_member[i][name][0] for i in holders)
        if len(holders) < len(per_member):
            lacking = [ranks[i] for i in range(len(per_member)) if i not in holders]
            mismatches.append(
                Mismatch(
                    name,
                    "structure",
                    lacking,
                    [ranks[i] for i in holders],
                    detail=f"missing on rank(s) {lacking}",
                )
            )
            continue
        values = [per_member[i][name][1] for i in holders]
        ref_pos, odd_pos = majority([json.dumps(v, sort_keys=True) for v in values])
        if not odd_pos:
            continue
        ref = values[ref_pos[0]]
        odd = [values[i] for i in odd_pos]
        shown = ", ".join(f"rank {ranks[i]} holds {_show(values[i])}" for i in odd_pos)
        mismatches.append(
            Mismatch(
                name,
                kind,
                [ranks[i] for i in odd_pos],
                [ranks[i] for i in ref_pos],
                shape=[],
                dtype=type(ref).__name__,
                max_abs_diff=_gap(odd, ref),
                detail=f"{shown}, rank {ranks[ref_pos[0]]} holds {_show(ref)}",
            )
        )
    return mismatches, len(names)
