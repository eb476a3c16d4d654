"""A distributed checkpoint loaded on another layout (a reshard): every saved shard compared where it is held.

At save, each rank's local tensors in the sidecar's ``rank_tensors`` carry their box in the global
tensor (``offset``, ``global_shape``). At load, every rank cuts each saved box that lies inside its own
shard out of what it now holds and digests it: the same elements in the same order as the rank that
saved them, so a reshard that restores the same global tensors (saved on 2 ranks, loaded on 1; FSDP on
4 loaded on 2) compares equal, and a box that differs names the rank holding it. A saved box that no
rank now holds whole (loaded on finer shards than it was saved in) is not compared, and is named.

>>> import torch
>>> saved = {"0": with_boxes(tensor_digests({"w": torch.arange(4.0)}), {"w": torch.arange(4.0)})}
>>> compare_boxes(saved, {"w": torch.arange(4.0)}, "")
([], [['w', '0']])
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch

from weightsync_audit.compat import dtensor_box, is_dtensor
from weightsync_audit.engine.checkpoints.sidecar import flat_tensors, tensor_digests
from weightsync_audit.engine.inventory.manifest import dtype_name

__all__ = ["compare_boxes", "has_boxes", "uncovered_boxes", "with_boxes"]


def _box(t: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """``(offset, global_shape)`` of what ``t`` holds of its global tensor (a plain tensor is all of it)."""
    if is_dtensor(t):
        return dtensor_box(t)
    return [0] * t.dim(), list(t.shape)


def with_boxes(tensors: dict[str, dict[str, Any]], obj: Any) -> dict[str, dict[str, Any]]:
    """``tensors`` (from :func:`tensor_digests` of ``obj``) with each entry's ``offset`` and
    ``global_shape`` added where its tensor is one box of its global tensor."""
    for name, t in flat_tensors(obj, local=False).items():
        box = _box(t)
        if box is not None and name in tensors:
            tensors[name]["offset"], tensors[name]["global_shape"] = box
    return tensors


def has_boxes(rank_tensors: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether a sidecar's ``rank_tensors`` record boxes (written by this version or later)."""
    return any("offset" in e for entries in rank_tensors.values() for e in entries.values())


def _inside(offset: list[int], shape: list[int], held_offset: list[int], held_shape: Iterable[int]) -> bool:
    return len(offset) == len(held_offset) and all(
        h <= o and o + s <= h + n for o, s, h, n in zip(offset, shape, held_offset, held_shape)
    )


def compare_boxes(
    saved: Mapping[str, Mapping[str, Any]], obj: Any, prefix: str, me: str = "0"
) -> tuple[list[str], list[list[str]]]:
    """This rank's names (as saved) whose held elements differ from a saved box, and the saved boxes it
    compared, as ``[name, saved_rank]``. ``saved`` is the sidecar's ``rank_tensors``; ``obj`` what this
    rank holds (DTensors as themselves); ``prefix`` where its names sit among the saved ones. A tensor
    that is not one box (a ``_StridedShard`` placement) is compared with what rank ``me`` saved, as is."""
    differ: list[str] = []
    compared: list[list[str]] = []
    for own, t in flat_tensors(obj, local=False).items():
        name = prefix + own
        box = _box(t)
        if box is None:
            e = saved.get(me, {}).get(name)
            if e is not None and "offset" not in e:
                now = tensor_digests({"t": t.to_local() if is_dtensor(t) else t})["t"]
                if (now["digest"], now["shape"], now["dtype"]) != (e["digest"], e["shape"], e.get("dtype")):
                    differ.append(name)
            continue
        held_offset, global_shape = box
        local = t.to_local() if is_dtensor(t) else t
        views: dict[str, torch.Tensor] = {}
        wanted: dict[str, Mapping[str, Any]] = {}
        for rank, entries in saved.items():
            e = entries.get(name)
            if e is None or "offset" not in e or math.prod(e["shape"]) == 0:
                continue
            if e.get("global_shape") != global_shape:
                views.clear()
                differ.append(name)  # the global tensor changed shape: nothing to cut
                compared += [[name, r] for r, ents in saved.items() if name in ents]
                break
            if _inside(e["offset"], e["shape"], held_offset, local.shape):
                cut = tuple(slice(o - h, o - h + n) for o, h, n in zip(e["offset"], held_offset, e["shape"]))
                views[rank], wanted[rank] = local.detach()[cut], e
        if not views:
            continue
        now = tensor_digests(views)
        if any(
            (now[r]["digest"], now[r]["dtype"]) != (e["digest"], e.get("dtype", dtype_name(local.dtype)))
            for r, e in wanted.items()
        ):
            differ.append(name)
        compared += [[name, r] for r in wanted]
    return sorted(set(differ)), compared


def uncovered_boxes(saved: Mapping[str, Mapping[str, Any]], compared: Iterable[Iterable[str]]) -> list[str]:
    """Names of the tensors with a saved box (not empty) that no rank compared."""
    seen = {tuple(c) for c in compared}
    return sorted(
        {
            name
            for rank, entries in saved.items()
            for name, e in entries.items()
            if "offset" in e and math.prod(e["shape"]) and (name, rank) not in seen
        }
    )
