"""Size of a divergence: a relative ``tolerance``, and telling numerical drift from a bug by the gap.

A tolerance is relative: a mismatch whose ``rel_diff`` (max |a - b| over max |reference|) is at most
it is kept in the record with ``within_tolerance: true``, and ``on_mismatch`` (raise, resync) acts
only on the others. A gap that could not be measured is never within a tolerance.

Classifying: a relative gap of a few hundred float32 ulps or less (a couple of ulps in 16-bit floats)
is the size that non-deterministic kernels and another reduction order leave; a larger one is the size
of a missed all-reduce, a local update, or a load on some ranks only.

>>> from weightsync_audit.reporting.record import Mismatch
>>> small = Mismatch("fc.weight", "param", [1], [0], [4], "float32", 2e-7, rel_diff=2e-7)
>>> big = Mismatch("fc.bias", "param", [1], [0], [4], "float32", 1e-2, rel_diff=3e-2)
>>> apply_tolerance([small, big], 1e-5)
>>> small.within_tolerance, big.within_tolerance
(True, False)
>>> [m.name for m in drift_sized([small, big])]
['fc.weight']
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import brief_names

__all__ = ["check_tolerance", "apply_tolerance", "drift_arguments", "drift_limit", "drift_sized", "drift_hint"]

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


def apply_tolerance(mismatches: Sequence[Mismatch], tolerance: float | None) -> None:
    """Set ``within_tolerance`` on each mismatch (left None when no tolerance is in force)."""
    if tolerance is None:
        return
    for m in mismatches:
        rel = m.rel_diff
        m.within_tolerance = m.kind != "structure" and rel is not None and math.isfinite(rel) and rel <= tolerance


def drift_limit(dtype: str | None) -> float | None:
    """The largest relative gap that numerical drift plausibly leaves in ``dtype`` (None: not a float)."""
    return _DRIFT_LIMIT.get(dtype or "")


def drift_sized(mismatches: Sequence[Mismatch]) -> list[Mismatch]:
    """The value mismatches whose measured relative gap is the size of float rounding."""
    out = []
    for m in mismatches:
        limit = drift_limit(m.dtype)
        if m.kind == "structure" or limit is None or m.rel_diff is None:
            continue
        if 0 < m.rel_diff <= limit:
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
    """``explain()``'s ``drifting`` and ``drift_hint`` for these mismatches."""
    drifting = drift_sized(mismatches)
    worst = max((m.rel_diff or 0.0 for m in drifting), default=0.0)
    return {"drifting": [m.name for m in drifting], "drift_hint": lambda names: drift_hint(names, worst)}
