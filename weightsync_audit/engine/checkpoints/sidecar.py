"""The sidecar a verified checkpoint carries: what was saved, digested, and whether the replicas agreed.

A single-file checkpoint ``epoch=3.ckpt`` gets ``epoch=3.ckpt.weightsync.json`` beside it; a checkpoint
folder (a Hugging Face ``checkpoint-N``, a ``torch.distributed.checkpoint`` directory) gets
``weightsync.json`` inside it, so it goes when the folder is rotated away. The sidecar is JSON:

``schema`` (``weightsync-checkpoint/1``), ``checkpoint`` (the path's base name), ``step``, ``epoch``,
``world_size``, ``time``, ``verdict`` (``verified``: every replica agreed at that step, in an audit that
compared every byte; ``diverged``: they did not, ``diverged`` names the tensors; ``sampled``: they agreed
on the slice a sampled audit read, which verifies nothing), ``coverage`` (``full``, or the ``k/n`` of a
sampled audit), ``tensors`` (dotted name in the saved object -> ``digest``
(16 hex digits of xxh3-64 over the tensor's exact bytes in logical order), ``dtype``, ``shape``), ``files``
(every file of the checkpoint -> ``bytes`` and ``digest``, xxh3-64 of its bytes when saved: what identifies
the files the sidecar describes; absent in sidecars of earlier versions, which are then *unidentified*),
``tied`` (a name -> the name it shares its tensor with: tied weights, which ``verify`` accepts saved once
under the other name, and nothing else) and, for a ``torch.distributed.checkpoint`` folder, ``shards`` (file
-> ``rank`` that wrote it, ``digest`` of the file's bytes, ``bytes``) and ``rank_tensors`` (rank -> that
rank's local tensors, as ``tensors``, each with its ``offset`` and ``global_shape`` in the global tensor).
Every read goes through :func:`read_sidecar`, which validates every field (``reporting/json_line.py``, the one validation kit).

A distributed checkpoint loaded on another layout (a reshard): every saved shard compared where it is held
(:func:`with_boxes`, :func:`compare_boxes`). At save, each rank's local tensors in ``rank_tensors`` carry
their box in the global tensor (``offset``, ``global_shape``). At load, every rank cuts each saved box that
lies inside its own shard out of what it now holds and digests it: the same elements in the same order as
the rank that saved them, so a reshard that restores the same global tensors (saved on 2 ranks, loaded on
1; FSDP on 4 loaded on 2) compares equal, and a box that differs names the rank holding it. A saved box that
no rank now holds whole (loaded on finer shards than it was saved in) is not compared, and is named.

>>> import torch
>>> entry = tensor_digests({"model": {"w": torch.ones(2)}})["model.w"]
>>> entry["dtype"], entry["shape"], len(entry["digest"])
('float32', [2], 16)
>>> saved = {"0": with_boxes(tensor_digests({"w": torch.arange(4.0)}), {"w": torch.arange(4.0)})}
>>> compare_boxes(saved, {"w": torch.arange(4.0)}, "")
([], [['w', '0']])
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from weightsync_audit.compat import dtensor_box, is_dtensor
from weightsync_audit.engine.checkpoints.folder import SIDECAR_NAME
from weightsync_audit.engine.checkpoints.load import flatten, read_json
from weightsync_audit.engine.hashing.digest import digest_tensors
from weightsync_audit.engine.hashing.reader import readable
from weightsync_audit.engine.inventory.manifest import dtype_name
from weightsync_audit.errors import CheckpointError
from weightsync_audit.reporting.json_line import SIDECAR_SCHEMA, SidecarError, validate_sidecar

__all__ = [
    "compare_boxes",
    "has_boxes",
    "uncovered_boxes",
    "with_boxes",
    "flat_tensors",
    "match_prefix",
    "new_sidecar",
    "read_sidecar",
    "same_digest",
    "sidecar_path",
    "tensor_digests",
    "tied_names",
    "write_sidecar",
]

_MASK64 = (1 << 64) - 1


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """Where ``path``'s sidecar lives: ``<file>.weightsync.json`` beside a file, ``<folder>/weightsync.json``.

    >>> sidecar_path("/ckpt/epoch=3.ckpt").name
    'epoch=3.ckpt.weightsync.json'
    """
    p = Path(path)
    return p / SIDECAR_NAME if p.is_dir() else p.with_name(p.name + ".weightsync.json")


def flat_tensors(obj: Any, prefix: str = "", *, local: bool = True) -> dict[str, torch.Tensor]:
    """Dotted name -> tensor for every tensor of :func:`~weightsync_audit.engine.checkpoints.load.flatten`
    (a DTensor enters as this rank's local shard; as itself with ``local=False``)."""
    flat = flatten(obj, prefix).items()
    return {n: v.to_local() if local and is_dtensor(v) else v for n, v in flat if isinstance(v, torch.Tensor)}


def _hex(d: int) -> str:
    return f"{d & _MASK64:016x}"


def tensor_digests(obj: Any) -> dict[str, dict[str, Any]]:
    """Name -> ``{"digest", "dtype", "shape"}`` for every tensor in ``obj`` (xxh3 of its exact bytes)."""
    flat = {n: readable(t, n) for n, t in flat_tensors(obj).items()}
    host = [t if t.device.type == "cpu" else t.cpu() for t in flat.values()]
    digests = digest_tensors(host, method="xxh3").tolist() if host else []
    return {
        n: {"digest": _hex(int(d)), "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        for (n, t), d in zip(flat.items(), digests)
    }


def same_digest(now: Mapping[str, Any], saved: Mapping[str, Any]) -> bool:
    """Whether a tensor's digest entry (:func:`tensor_digests`) is the one saved: digest, shape and dtype (a
    sidecar of an earlier version has none)."""
    return (now["digest"], now["shape"], now["dtype"]) == (saved["digest"], saved["shape"], saved.get("dtype"))


def tied_names(obj: Any) -> dict[str, str]:
    """Name -> the first name holding the very same tensor (same storage, offset, shape and strides): tied
    weights, which a folder format may save once (``model.safetensors`` drops ``lm_head.weight``).

    >>> w = torch.ones(2)
    >>> tied_names({"a": w, "b": w, "c": torch.ones(2)})
    {'b': 'a'}
    """
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for name, t in flat_tensors(obj).items():
        if t.numel() == 0 or t.device.type == "meta":
            continue
        key = (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def new_sidecar(
    path: str | os.PathLike[str],
    *,
    step: int | None,
    epoch: int | None,
    world_size: int,
    in_sync: bool,
    diverged: Iterable[str],
    tensors: Mapping[str, Any],
    coverage: str | None = None,
) -> dict[str, Any]:
    """The sidecar object (see the module's docstring for its fields); ``coverage``: the ``k/n`` of a
    sampled audit (``None``: it read every byte)."""
    verdict = "diverged" if not in_sync else ("sampled" if coverage else "verified")
    return {
        "schema": SIDECAR_SCHEMA,
        "checkpoint": Path(path).name,
        "step": step,
        "epoch": epoch,
        "world_size": int(world_size),
        "time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "verdict": verdict,
        "coverage": coverage or "full",
        "diverged": sorted(set(diverged)),
        "tensors": dict(tensors),
    }


def write_sidecar(path: str | os.PathLike[str], sidecar: Mapping[str, Any]) -> Path:
    """Write ``sidecar`` for the checkpoint at ``path`` atomically (a reader never sees half of it)."""
    target = sidecar_path(path)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(sidecar, separators=(",", ":")))
    os.replace(tmp, target)
    return target


def read_sidecar(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The sidecar of the checkpoint at ``path``, validated, or ``None`` when it has none;
    :class:`SidecarError` naming the file and the field when it has one that is unreadable or malformed."""
    target = sidecar_path(path)
    if not target.exists() and not target.is_symlink():
        return None
    try:
        data = read_json(target, "sidecar")
    except CheckpointError as exc:
        raise SidecarError(str(exc)) from None
    validate_sidecar(data, str(target))
    return data


def match_prefix(saved: Iterable[str], held: Iterable[str], *, by_digest: bool = False) -> str:
    """The prefix under which names ``held`` (a model's ``state_dict`` keys) sit among ``saved`` (a
    sidecar's names): ``"state_dict."`` for a Lightning checkpoint, ``""`` for a plain state dict; where most
    of them are found and, ``by_digest`` (both name -> digest entry), among those where most have the digest
    ``held`` says (a file holding the model twice, ``model.`` and ``ema.``, is read where the saved one is).

    >>> match_prefix(["epoch", "state_dict.w", "state_dict.b"], ["w", "b"])
    'state_dict.'
    """
    names, among = list(held), saved if isinstance(saved, Mapping) else set(saved)
    cands = {""}
    for n in names[:8]:
        cands |= {k[: len(k) - len(n)] for k in among if k.endswith(n) and (len(k) == len(n) or k[-len(n) - 1] in "./")}

    def score(p: str) -> tuple[int, int]:
        found = [n for n in names if p + n in among]
        return len(found), sum(among[p + n]["digest"] == held[n]["digest"] for n in found) if by_digest else 0  # type: ignore[index]

    return max(sorted(cands), key=score)


# -- a reshard: the saved shards' boxes --------------------------------------------------------------------


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
                now = tensor_digests({"t": t})["t"]  # a DTensor: its local shard (the reader)
                if not same_digest(now, e):
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
