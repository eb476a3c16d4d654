"""How large a divergence is: ``max_abs_diff`` between two copies of a tensor, measured piece by piece.

:class:`GapMeter` takes the two copies a chunk at a time (as the data plane delivers them) and keeps
only three numbers, max |a - b|, max |reference| and how many elements differ, so measuring a tensor of
any size costs a bounded amount of memory: the temporaries cover at most ``STEP`` elements at once. Half
and single precision are compared in float32, other floats (and any piece holding NaN or inf) in
float64 / complex128, integers in integer arithmetic (an int64 gap of 1 above 2**53 stays 1).

Kept apart from the engine so that ``weightsync-audit diff`` measures checkpoints without loading the
audit channel.

Size of a divergence: a relative ``tolerance``, and telling numerical drift from a bug by the gap.

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

import torch

from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import brief_names

__all__ = [
    "DRIFT_MIN_COUNT",
    "DRIFT_MIN_SHARE",
    "GapMeter",
    "STEP",
    "apply_tolerance",
    "check_tolerance",
    "drift_arguments",
    "drift_hint",
    "drift_limit",
    "drift_sized",
    "drift_spread",
    "is_floating",
    "max_abs_diff",
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


_SINGLE = (torch.float32, torch.float16, torch.bfloat16)

STEP = 1 << 18
"""Elements per float64 temporary (2 MiB each): the memory bound of a measurement."""


class GapMeter:
    """Running max |a - b| and max |reference| over chunks of two copies of one tensor.

    NaN against NaN and an infinity against the same infinity count as equal; NaN or inf against any
    other value counts as an infinite gap.

    >>> import torch
    >>> m = GapMeter()
    >>> m.update(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    >>> m.max_abs_diff, m.max_reference, m.diff_count
    (0.5, 2.5, 1)
    """

    __slots__ = ("diff_count", "max_abs_diff", "max_reference")

    def __init__(self) -> None:
        self.max_abs_diff = 0.0
        self.max_reference = 0.0
        self.diff_count = 0
        """Elements whose values differ (NaN against NaN, and the same infinity, count as equal)."""

    def update(self, mine: torch.Tensor, reference: torch.Tensor) -> None:
        """Fold in one chunk: ``mine`` and ``reference`` hold the same elements, same shape and dtype."""
        a, b = mine.reshape(-1), reference.reshape(-1)
        if a.numel() != b.numel():
            raise ValueError(f"chunks differ in size: {a.numel()} and {b.numel()} elements")
        for i in range(0, a.numel(), STEP):
            d, r, n = _piece(a[i : i + STEP], b[i : i + STEP])
            self.max_abs_diff = max(self.max_abs_diff, d)
            self.max_reference = max(self.max_reference, r)
            self.diff_count += n

    @property
    def rel_diff(self) -> float | None:
        """max |a - b| over max |reference|; ``None`` when the reference is all zeros and they differ."""
        if self.max_abs_diff == 0:
            return 0.0
        if self.max_reference == 0 or math.isinf(self.max_abs_diff):
            return None
        return self.max_abs_diff / self.max_reference


def _piece(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int]:
    """(max |a - b|, max |b|, how many elements differ) of two small pieces."""
    if a.numel() == 0:
        return 0.0, 0.0, 0
    if a.dtype == torch.bool:
        return float((a != b).any()), float(b.any()), int((a != b).sum())
    if not (a.is_floating_point() or a.is_complex()):
        return _integer_piece(a, b)
    if a.dtype in _SINGLE:
        # Single precision first, in place: 3-4x faster than float64 (measured, one thread). A float32
        # difference is exact when the values are within a factor of 2 (Sterbenz), else rounded to
        # 6e-8 relative; a piece with NaN or inf is redone below in float64 with the rules above.
        a32, b32 = a.float(), b.float()
        d32 = torch.sub(a32, b32).abs_()
        worst = float(d32.amax())
        if math.isfinite(worst):
            return worst, float(b32.abs().amax()), int(torch.count_nonzero(d32))
    if a.is_complex():
        a64, b64 = a.to(torch.complex128), b.to(torch.complex128)
    else:
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
    d = (a64 - b64).abs()
    worst = float(d.max())
    if math.isfinite(worst):  # the common case: no NaN or inf on either side (they would show here)
        return worst, float(b64.abs().max()), int(torch.count_nonzero(d))
    both_nan = torch.isnan(a64) & torch.isnan(b64)
    same_inf = torch.isinf(a64) & (a64 == b64)
    d = torch.where(both_nan | same_inf, torch.zeros_like(d), d)
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    ref = b64.abs()
    ref = ref[torch.isfinite(ref)]
    return float(d.max()), float(ref.max()) if ref.numel() else 0.0, int(torch.count_nonzero(d))


_EXACT_BELOW = float(2**62)
"""An integer gap below this is taken from int64 arithmetic (exact); above it, from float64 (it cannot wrap)."""


def _integer_piece(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int]:
    """Integers compared in integers: float64 would round 2**53 + 1 to 2**53 and lose a gap of 1."""
    a64, b64 = a.to(torch.int64), b.to(torch.int64)
    rough = (a64.to(torch.float64) - b64.to(torch.float64)).abs()  # only to see where int64 would wrap
    exact = torch.where(a64 >= b64, a64 - b64, b64 - a64)  # wraps only where rough >= 2**62
    d = torch.where(rough < _EXACT_BELOW, exact, torch.zeros_like(exact))
    worst = max(int(d.max()), float(rough.max()) if bool((rough >= _EXACT_BELOW).any()) else 0)
    return float(worst), float(b64.to(torch.float64).abs().max()), int(torch.count_nonzero(a64 != b64))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over two host tensors of the same shape (see :class:`GapMeter` for NaN and inf)."""
    meter = GapMeter()
    meter.update(a.detach().reshape(-1), b.detach().reshape(-1))
    return meter.max_abs_diff
