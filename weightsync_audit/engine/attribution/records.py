"""A rank's step records, frozen once written, and how a tensor changed at rest: :class:`StepRecord`,
:class:`Change`, :func:`classify`.

How it changed, a bit flip or a write: two cheap facts tell a write from the memory, taken only for the
tensors that changed:

- its **version counter** (stamped after every step, one integer per tensor): torch bumps it at every
  in-place write through the tensor or a view of it, so a counter that moved is a write by code, never
  the memory (a write through ``.data`` or a raw pointer does not move it, nor does a bit flip);
- **how many elements and bits** changed, against this rank's own post-step bytes where it holds them
  (the update replay's replayed values, :attr:`~.replay.UpdateReplay.reference`, kept until the next step):
  a bit flip changes one element by one bit (a multi-bit upset a few, in one or two elements), a write
  changes elements by many bits.

:func:`classify` reads them: ``write`` (software), ``flip`` (hardware-suspect) or ``unknown``.

>>> import torch
>>> before = torch.tensor([1.0, 2.0, 3.0])
>>> after = before.clone()
>>> after.view(torch.int32)[1] ^= 1 << 4
>>> counted = count_changes(after, before)
>>> counted, classify([Change.of({"name": "w", "moved": False, **counted})])
({'elements': 1, 'compared': 3, 'bits': 1, 'max_abs': 3.814697265625e-06}, 'flip')

A rank's records are frozen from the moment they are written, :class:`StepRecord` (one a step) holding
:class:`Change` (one a tensor changed at rest); they reach the others as JSON (``as_dict``) and are read back
(``of``) into the same records: what the blame decides from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from weightsync_audit.engine.hashing.reader import byte_view

__all__ = [
    "Change",
    "StepRecord",
    "FLIP_BITS",
    "FLIP_ELEMENTS",
    "MAX_NAMES",
    "change_evidence",
    "classify",
    "count_changes",
]

FLIP_ELEMENTS = 2
"""At most this many elements changed, by at most :data:`FLIP_BITS` bits each: what the memory does."""
FLIP_BITS = 3
_BITS_UP_TO = 4096
"""Bits are counted when at most this many elements changed (a larger change is a write anyway)."""


MAX_NAMES = 8
"""Tensor names a record keeps per finding (the count is kept too)."""


def count_changes(now: torch.Tensor, reference: torch.Tensor) -> dict[str, Any] | None:
    """How many elements of ``now`` differ from ``reference``, by how many bits and (floats) how far at most
    (``max_abs``; None: not comparable)."""
    if now.shape != reference.shape or now.dtype != reference.dtype or now.device != reference.device:
        return None
    size = now.element_size()
    a, b = (byte_view(t.detach()).reshape(-1, size) for t in (now, reference))
    xor = torch.bitwise_xor(a, b)
    changed = xor.ne(0).any(dim=1)
    elements = int(changed.sum())
    out: dict[str, Any] = {"elements": elements, "compared": int(now.numel()), "bits": None}
    if elements <= _BITS_UP_TO:
        out["bits"] = int(np.unpackbits(xor[changed].cpu().numpy().reshape(-1)).sum())
    if elements and now.is_floating_point():  # how far it moved: weighed against the gap the audit measured
        diff = now.detach().reshape(-1)[changed].double() - reference.detach().reshape(-1)[changed].double()
        moved = diff.abs().nan_to_num(nan=math.inf)
        out["max_abs"] = float(moved.max())
    return out


def change_evidence(
    name: str, t: torch.Tensor | None, version: int, stamp: int, reference: torch.Tensor | None
) -> Change:
    """How ``t`` (``name``) changed: whether its version counter moved (``version`` now against ``stamp``,
    the post-step one; -1 where either is unknown) and, against ``reference``, how many elements and bits."""
    counted: dict[str, Any] = {}
    if reference is not None and t is not None:
        try:
            counted = count_changes(t, reference) or {}
        except Exception:  # noqa: BLE001 - the count is evidence, never a failure of the step
            pass
    moved = version != stamp if min(version, stamp) >= 0 else None
    return Change(name, int(t.numel()) if t is not None else None, moved, **counted)


@dataclass(frozen=True, slots=True)
class Change:
    """How one tensor changed at rest (a record's ``rest_evidence``: :func:`change_evidence`)."""

    name: str = "?"
    numel: int | None = None
    moved: bool | None = None
    """Whether its version counter moved since the post-step stamp (``None``: unknown)."""
    elements: int | None = None
    """Elements that differ from this rank's post-step bytes (``None``: not counted), of ``compared``."""
    compared: int | None = None
    bits: int | None = None
    """Bits that differ in them (``None``: not counted, too many elements)."""
    max_abs: float | None = None
    """How far it moved at most (floats; ``None``: not measured)."""

    @classmethod
    def of(cls, wire: Mapping[str, Any]) -> Change:
        """From its JSON (keys it does not know, from another version, are left out)."""
        return cls(**{k: wire[k] for k in _FIELDS[cls] if k in wire})

    def as_dict(self) -> dict[str, Any]:
        """Its JSON (what :meth:`of` reads back): ``moved`` and ``max_abs`` where known, the counts where counted."""
        kept = ("name", "numel", *(("bits",) if self.elements is not None else ()))
        return {k: getattr(self, k) for k in _FIELDS[Change] if k in kept or getattr(self, k) is not None}


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One rank's record of one optimizer step, as the watch writes it (absent fields: not taken)."""

    step: int | None = None
    seq: int = 0
    """The second optimizer step under one step number is 1 (several optimizers, a manual second step)."""
    stepped: bool = False
    pre: int | None = None
    """The digest at rest right before the step (``None``: not read, or read too late)."""
    post: int | None = None
    """The digest at rest right after it."""
    rest: tuple[str, ...] = ()
    """What changed at rest in between (up to :data:`MAX_NAMES` names), how: ``rest_evidence``."""
    rest_count: int = 0
    rest_evidence: tuple[Change, ...] = ()
    rest_read: str | None = None
    hyper: int | None = None
    hyper_changed: str | None = None
    """The hyper-parameters that changed at rest before the step, ``"lr 0.1 -> 0.2"``."""
    hyper_text: str | None = None
    grads: int | None = None
    """The gradients' digest right before the step (``None``: not read)."""
    grads_changed: tuple[str, ...] = ()
    """The gradients that changed after the all-reduce gave them."""
    buckets: tuple[tuple[int, int], ...] = ()
    """The all-reduce's digest of each bucket, ``(bucket, digest)``."""
    update: tuple[str, ...] = ()
    """The parameters whose update the replay did not reproduce."""
    covered: int = 0
    replayable: int = 0
    too_large: int = 0
    declined: str | None = None
    failed: str | None = None
    """A check that failed, and why."""

    @classmethod
    def of(cls, wire: Mapping[str, Any]) -> StepRecord:
        """From its JSON (lists read as tuples; keys it does not know, from another version, left out)."""
        got = {k: wire[k] for k in _FIELDS[cls] if k in wire and wire[k] is not None}
        for k in ("rest", "grads_changed", "update"):
            if k in got:
                got[k] = tuple(got[k])
        got["buckets"] = tuple((int(b), int(d)) for b, d in got.get("buckets", ()))
        got["rest_evidence"] = tuple(Change.of(e) for e in got.get("rest_evidence", ()))
        return cls(**got)

    def as_dict(self) -> dict[str, Any]:
        """Its JSON (what :meth:`of` reads back): ``step``, ``stepped`` and every field not at its default."""
        taken = ((f.name, getattr(self, f.name), f.default) for f in fields(self))
        return {k: _plain(v) for k, v, default in taken if v != default or k in ("step", "stepped")}


def _plain(v: Any) -> Any:
    return [_plain(x) for x in v] if isinstance(v, tuple) else v.as_dict() if isinstance(v, Change) else v


_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in (Change, StepRecord)}


def classify(evidence: Sequence[Change]) -> str:
    """``write`` (a version counter moved, or too many elements or bits changed for the memory), ``flip``
    (every changed tensor counted, at most :data:`FLIP_ELEMENTS` elements by at most :data:`FLIP_BITS` bits
    each, no counter moved) or ``unknown`` (nothing counted, no counter moved)."""
    if any(e.moved for e in evidence):
        return "write"
    counted = [e for e in evidence if e.elements is not None]
    if not counted:
        return "unknown"
    elements = sum(e.elements or 0 for e in counted)
    if elements == 0:
        return "unknown"  # the kept bytes are not this step's: nothing told
    bits = [e.bits for e in counted]
    if elements > FLIP_ELEMENTS or None in bits or sum(b for b in bits if b) > FLIP_BITS * max(1, elements):
        return "write"
    if len(counted) < len(evidence):
        return "unknown"  # some changed tensor was not counted: it may hold the write
    return "flip"
