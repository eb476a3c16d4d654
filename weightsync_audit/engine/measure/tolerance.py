"""Size of a divergence: a relative ``tolerance``, and telling numerical drift from a bug by the gap.

A tolerance is relative: a mismatch whose ``rel_diff`` (max |a - b| over max |reference|) is at most
it, and which is spread like drift (below), is kept in the record with ``within_tolerance: true``, and
``on_mismatch`` (raise, resync) acts only on the others. A gap that could not be measured is never
within a tolerance, and neither is any integer or bool tensor: a step counter or ``num_batches_tracked``
off by one is a bug, whatever its relative size.

Drift, by size and spread: numerical drift (non-deterministic kernels, another reduction order) touches
many elements of a tensor by a few hundred float32 ulps or less (a couple of ulps in 16-bit floats). A
difference is drift-shaped only when all of these hold:

- the dtype is a float (or complex) and the relative gap is at most the dtype's drift limit;
- at least :data:`DRIFT_MIN_COUNT` (32) elements differ;
- they are at least :data:`DRIFT_MIN_SHARE` (1 %) of the tensor's elements.

So a localized difference (one row of a large embedding, a handful of elements, a small tensor wholly
different) is never called drift, however small the gap: it is the shape of a missed update. (Values
equal and bytes not, ``-0.0`` against ``0.0``: no element differs, ``rel_diff`` 0, within any tolerance.)

>>> from weightsync_audit.reporting.record import Mismatch
>>> small = Mismatch("fc.weight", "param", [1], [0], [64, 64], "float32", 2e-7, rel_diff=2e-7, diff_count=4000)
>>> big = Mismatch("fc.bias", "param", [1], [0], [64], "float32", 1e-2, rel_diff=3e-2, diff_count=64)
>>> one = Mismatch("emb.weight", "param", [1], [0], [50000, 64], "float32", 1e-4, rel_diff=2e-5, diff_count=64)
>>> apply_tolerance([small, big, one], 1e-4)
>>> small.within_tolerance, big.within_tolerance, one.within_tolerance
(True, False, False)
>>> [m.name for m in drift_sized([small, big, one])]
['fc.weight']
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import brief_names

__all__ = [
    "DRIFT_MIN_COUNT",
    "DRIFT_MIN_SHARE",
    "check_tolerance",
    "apply_tolerance",
    "drift_arguments",
    "drift_limit",
    "drift_sized",
    "drift_hint",
    "drift_spread",
    "is_floating",
]

DRIFT_MIN_COUNT = 32
"""Fewer differing elements than this is a localized difference, never drift."""
DRIFT_MIN_SHARE = 0.01
"""A smaller share of the tensor's elements differing is a localized difference, never drift."""

_DRIFT_LIMIT = {
    "float64": 1e-4,
    "float32": 1e-4,  # about 800 ulps: what many steps of reordered sums accumulate
    "float16": 4 * 2.0**-10,
    "bfloat16": 4 * 2.0**-7,
}


def check_tolerance(tolerance: float | None, argument: str = "tolerance") -> float | None:
    """``tolerance`` as a float, or a ``ValueError`` naming ``argument``."""
    if tolerance is None:
        return None
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise ValueError(f"{argument}={tolerance!r}: must be a relative gap such as 1e-5, or None for exact")
    value = float(tolerance)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{argument}={tolerance!r}: must be a finite number >= 0, or None for exact")
    return value


def is_floating(dtype: str | None) -> bool:
    """A float or complex dtype name (``float32``, ``bfloat16``, ``float8_e4m3fn``, ``complex64``)."""
    name = dtype or ""
    return name.startswith(("float", "bfloat", "complex"))


def drift_spread(m: Mismatch) -> bool:
    """The differing elements are many and spread over the tensor, as drift leaves them (see above)."""
    if m.diff_count is None or m.shape is None:
        return False
    if m.diff_count == 0:
        return True  # the values are equal (``-0.0`` against ``0.0``): nothing differs to localize
    share = m.diff_share
    return m.diff_count >= DRIFT_MIN_COUNT and share is not None and share >= DRIFT_MIN_SHARE


def apply_tolerance(mismatches: Sequence[Mismatch], tolerance: float | None) -> None:
    """Set ``within_tolerance`` on each mismatch (left None when no tolerance is in force)."""
    if tolerance is None:
        return
    for m in mismatches:
        rel = m.rel_diff
        m.within_tolerance = (
            m.kind != "structure"
            and is_floating(m.dtype)
            and rel is not None
            and math.isfinite(rel)
            and rel <= tolerance
            and drift_spread(m)
        )


def drift_limit(dtype: str | None) -> float | None:
    """The largest relative gap that numerical drift plausibly leaves in ``dtype`` (None: not a float)."""
    return _DRIFT_LIMIT.get(dtype or "")


def drift_sized(mismatches: Sequence[Mismatch]) -> list[Mismatch]:
    """The value mismatches whose measured relative gap is the size of float rounding, spread like drift."""
    out = []
    for m in mismatches:
        limit = drift_limit(m.dtype)
        if m.kind == "structure" or limit is None or m.rel_diff is None:
            continue
        if 0 < m.rel_diff <= limit and drift_spread(m):
            out.append(m)
    return out


def drift_hint(names: Sequence[str], worst: float) -> str:
    """The hint for tensors whose relative gap (at most ``worst``) is the size of float rounding."""
    return (
        f"{brief_names(names)} differ by at most {worst:.2g} of their magnitude, the size "
        "of float rounding: numerical drift is likely (non-deterministic kernels such as atomics in "
        "scatter/index_add or cuBLAS/cuDNN algorithm choice, reductions summed in another order, tensor-parallel "
        "peers that compute the same update separately, pytorch#160169). Drift accumulates step after step: "
        "if the gap grows from audit to audit, resync periodically or make the kernels deterministic "
        "(torch.use_deterministic_algorithms(True)); set tolerance= to keep such gaps from raising."
    )


def drift_arguments(mismatches: Sequence[Mismatch]) -> dict[str, Any]:
    """The hints' :class:`~weightsync_audit.engine.explain.evidence.Evidence` ``drifting`` and ``drift_hint``
    for these mismatches."""
    drifting = drift_sized(mismatches)
    worst = max((m.rel_diff or 0.0 for m in drifting), default=0.0)
    return {"drifting": [m.name for m in drifting], "drift_hint": lambda names: drift_hint(names, worst)}
