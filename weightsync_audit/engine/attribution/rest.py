"""What changed at rest, and how: a bit flip or a write.

A tensor that changed between a rank's post-step digest and its next pre-step digest changed at rest.
Two cheap facts tell a write from the memory, taken only for the tensors that changed:

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
>>> counted, classify([{"moved": False, **counted}])
({'elements': 1, 'compared': 3, 'bits': 1}, 'flip')
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from weightsync_audit.compat import tensor_version
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest

__all__ = [
    "FLIP_BITS",
    "FLIP_ELEMENTS",
    "change_evidence",
    "classify",
    "count_changes",
    "rest_evidence",
    "tensors_at",
    "versions",
]

FLIP_ELEMENTS = 2
"""At most this many elements changed, by at most :data:`FLIP_BITS` bits each: what the memory does."""
FLIP_BITS = 3
_BITS_UP_TO = 4096
"""Bits are counted when at most this many elements changed (a larger change is a write anyway)."""


def _version(t: Any) -> int:
    try:
        return tensor_version(t)
    except Exception:  # noqa: BLE001 - a tensor without a counter (an inference tensor) stamps nothing
        return -1


def versions(prepared: PreparedManifest) -> np.ndarray:
    """The version counter of every entry's tensor, in manifest order (-1 where there is none)."""
    out = np.full(prepared.size, -1, dtype=np.int64)
    plan = prepared.plan
    if len(plan.all_index) and len(prepared.sources) == len(plan.all_index):
        out[plan.all_index] = np.fromiter(map(_version, prepared.sources), np.int64, len(prepared.sources))
    if len(plan.dyn_index) and len(prepared.dynamic) == len(plan.dyn_index):
        out[plan.dyn_index] = np.fromiter(map(_version, prepared.dynamic), np.int64, len(prepared.dynamic))
    return out


def tensors_at(prepared: PreparedManifest, positions: Sequence[int]) -> list[torch.Tensor | None]:
    """The tensors the audit reads at manifest ``positions`` (the parameters themselves where cached)."""
    plan = prepared.plan
    where: dict[int, torch.Tensor] = {}
    if len(prepared.sources) == len(plan.all_index):
        where.update(zip(plan.all_index.tolist(), prepared.sources))
    if len(prepared.dynamic) == len(plan.dyn_index):
        where.update(zip(plan.dyn_index.tolist(), prepared.dynamic))
    return [where.get(int(i)) for i in positions]


def count_changes(now: torch.Tensor, reference: torch.Tensor) -> dict[str, Any] | None:
    """How many elements of ``now`` differ from ``reference`` and by how many bits (None: not comparable)."""
    if now.shape != reference.shape or now.dtype != reference.dtype or now.device != reference.device:
        return None
    size = now.element_size()
    a = now.detach().contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
    b = reference.detach().contiguous().reshape(-1).view(torch.uint8).reshape(-1, size)
    xor = torch.bitwise_xor(a, b)
    changed = xor.ne(0).any(dim=1)
    elements = int(changed.sum())
    out: dict[str, Any] = {"elements": elements, "compared": int(now.numel()), "bits": None}
    if elements <= _BITS_UP_TO:
        out["bits"] = int(np.unpackbits(xor[changed].cpu().numpy().reshape(-1)).sum())
    return out


def rest_evidence(
    prepared: PreparedManifest,
    positions: Sequence[int],
    names: Sequence[str],
    stamped: np.ndarray | None,
    reference: dict[str, torch.Tensor],
) -> list[dict[str, Any]]:
    """For each changed tensor (manifest ``positions``, their ``names``): whether its version counter moved
    since ``stamped`` (the post-step stamps) and, against ``reference``, how many elements and bits changed."""
    now = versions(prepared) if stamped is not None else None
    out = []
    for pos, name, t in zip(positions, names, tensors_at(prepared, positions)):
        known = now is not None and stamped is not None and pos < len(stamped)
        out.append(change_evidence(name, t, int(now[pos]) if known else -1, int(stamped[pos]) if known else -1,
                                   reference.get(name)))  # fmt: skip
    return out


def change_evidence(
    name: str, t: torch.Tensor | None, version: int, stamp: int, reference: torch.Tensor | None
) -> dict[str, Any]:
    """How ``t`` (``name``) changed: whether its version counter moved (``version`` now against ``stamp``,
    the post-step one; -1 where either is unknown) and, against ``reference``, how many elements and bits."""
    ev: dict[str, Any] = {"name": name, "numel": int(t.numel()) if t is not None else None}
    if min(version, stamp) >= 0:
        ev["moved"] = version != stamp
    if reference is not None and t is not None:
        try:
            ev.update(count_changes(t, reference) or {})
        except Exception:  # noqa: BLE001 - the count is evidence, never a failure of the step
            pass
    return ev


def classify(evidence: Sequence[dict[str, Any]]) -> str:
    """``write`` (a version counter moved, or too many elements or bits changed for the memory), ``flip``
    (every changed tensor counted, at most :data:`FLIP_ELEMENTS` elements by at most :data:`FLIP_BITS` bits
    each, no counter moved) or ``unknown`` (nothing counted, no counter moved)."""
    if any(e.get("moved") for e in evidence):
        return "write"
    counted = [e for e in evidence if e.get("elements") is not None]
    if not counted:
        return "unknown"
    elements = sum(e["elements"] for e in counted)
    if elements == 0:
        return "unknown"  # the kept bytes are not this step's: nothing told
    bits = [e.get("bits") for e in counted]
    if elements > FLIP_ELEMENTS or None in bits or sum(b for b in bits if b) > FLIP_BITS * max(1, elements):
        return "write"
    if len(counted) < len(evidence):
        return "unknown"  # some changed tensor was not counted: it may hold the write
    return "flip"
