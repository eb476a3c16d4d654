"""How to audit: one :class:`AuditConfig`, validated once, taken by :func:`~weightsync_audit.audit`,
:class:`~weightsync_audit.Auditor` and every callback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from weightsync_audit.engine.attribution import AttributionConfig
from weightsync_audit.engine.inventory.manifest import check_include
from weightsync_audit.engine.measure.tolerance import check_tolerance

__all__ = [
    "AuditConfig",
    "Method",
    "OnMismatch",
    "check_count",
    "check_exclude",
    "check_flag",
    "check_on_mismatch",
    "check_seconds",
    "parse_coverage",
]

Method = Literal["auto", "xxh3", "device"]
"""``auto``: xxh3 on CPU and on-device digests on accelerators; ``xxh3``; ``device``."""

OnMismatch = Literal["warn", "raise", "resync"]
"""What a callback does when ranks disagree: report, raise on every rank together, or repair and confirm."""


def check_on_mismatch(on_mismatch: object) -> OnMismatch:
    """Validate a callback's ``on_mismatch`` argument, naming it in the error.

    >>> check_on_mismatch("raise")
    'raise'
    """
    if on_mismatch not in get_args(OnMismatch):
        raise ValueError(f"on_mismatch={on_mismatch!r}: choose from {list(get_args(OnMismatch))}")
    return on_mismatch  # type: ignore[return-value]


def parse_coverage(coverage: float | int | str, argument: str = "coverage") -> int:
    """Number of slices for a coverage such as ``1``, ``1/8``, ``0.125`` or ``"1/8"``; a ``ValueError``
    naming ``argument`` for anything else.

    >>> parse_coverage("1/8"), parse_coverage(1)
    (8, 1)
    >>> parse_coverage("1/0", "pinpoint_coverage")
    Traceback (most recent call last):
    ValueError: pinpoint_coverage='1/0': must be 1 or 1/n for a whole number n >= 1, e.g. 1/8
    """
    what = f"{argument}={coverage!r}"
    value: float
    try:
        if isinstance(coverage, bool):
            raise TypeError
        if isinstance(coverage, str):
            num, sep, den = coverage.strip().partition("/")
            value = float(num) / float(den) if sep else float(num)
        else:
            value = float(coverage)
    except (TypeError, ValueError, ZeroDivisionError):
        raise ValueError(f"{what}: must be 1 or 1/n for a whole number n >= 1, e.g. 1/8") from None
    if not (0 < value <= 1) or math.isnan(value):
        raise ValueError(f"{what}: must be in (0, 1], e.g. 1 or 1/8")
    slices = round(1 / value)
    if abs(slices * value - 1) > 1e-6:
        raise ValueError(f"{what}: must be 1/n for a whole number n, e.g. 1/8")
    return slices


def check_flag(value: object, argument: str) -> bool:
    """A yes/no option: ``True`` or ``False`` (``0`` and ``1`` read as them), else a ``TypeError`` naming ``argument``.

    >>> check_flag(1, "verbose")
    True
    """
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{argument}={value!r}: must be True or False")


def check_count(value: object, argument: str, least: int = 0) -> int:
    """A whole number ``>= least``, else a ``ValueError`` naming ``argument``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{argument}={value!r}: must be an integer >= {least}")
    return value


def check_seconds(value: object, argument: str, *, optional: bool = True) -> float | None:
    """A finite number of seconds ``> 0`` (or ``None`` with ``optional``), else a ``ValueError`` naming ``argument``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        none = ", or None for no deadline" if optional else ""
        raise ValueError(f"{argument}={value!r}: must be a positive, finite number of seconds{none}")
    return value


def check_exclude(exclude: object, argument: str = "exclude") -> tuple[str, ...]:
    """Glob patterns over names: one string or a sequence of them, else an error naming ``argument``."""
    if isinstance(exclude, str):
        return (exclude,)
    try:
        patterns = tuple(exclude)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{argument}={exclude!r}: give glob patterns over names, e.g. ('*.running_*',)") from None
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{argument}={patterns!r}: patterns must be strings")
    return patterns


@dataclass(kw_only=True, slots=True)
class AuditConfig:
    """How to audit. Every rank must use the same settings (checked: a difference is out of step)."""

    include: tuple[str, ...] = ("params", "buffers", "optimizer")
    """Kinds to audit: ``params``, ``buffers``, ``optimizer``, ``grads``."""
    exclude: tuple[str, ...] = ()
    """Glob patterns over names (``*.running_*``, ``head.*``) left out of the audit."""
    timeout_s: float | None = None
    """Deadline for the ranks to meet; a missing rank makes the others raise ``AuditTimeoutError``."""
    slices: int = 1
    """Sampled mode: each audit hashes slice ``i % slices`` of every large tensor (``coverage=1/slices``)."""
    method: Method = "auto"
    """``auto``: xxh3 on CPU and on-device digests on accelerators; ``xxh3``; ``device``."""
    max_diff_tensors: int = 8
    """How many diverged tensors get a ``max_abs_diff`` (each costs sharing one tensor)."""
    max_diff_bytes: int = 1 << 30
    """Tensors larger than this get no ``max_abs_diff``."""
    gap_budget_s: float = 60.0
    """Seconds that measuring gaps may add to a divergent audit. Reference copies move at an assumed
    32 MiB/s at worst, plus the grace; a tensor whose copy would not fit gets ``detail`` "gap not
    measured: ..." instead of a ``max_abs_diff`` (60 s: about 1.7 GiB of copies)."""
    compare_broadcast_buffers: bool = False
    """Compare buffers even when DDP overwrites them from rank 0 at every forward (false alarms)."""
    ddp_broadcast_buffers: bool | None = None
    """Whether DDP overwrites the buffers from its first rank at every forward, for a caller that audits
    the unwrapped module (a Hugging Face callback); ``None``: read it from the DDP wrapper in ``module``."""
    tolerance: float | None = None
    """Relative gap (``rel_diff``) under which a mismatch is ``within_tolerance``; None: exact. With one
    set, every diverged tensor's gap is measured (up to ``max_diff_bytes`` each)."""
    pinpoint: bool = False
    """Keep a per-step digest ring (``Auditor.record_step``) to find the exact step a divergence began."""
    pinpoint_ring: int = 1024
    """Steps the pinpoint ring holds between audits."""
    pinpoint_slices: int = 1
    """Per-step digests hash slice ``step % n`` of every large tensor (``pinpoint_coverage=1/n``)."""
    check_finite: bool = False
    """Count the audited tensors holding NaN or inf at every audit (one pass over the floating tensors
    and one small exchange; cost in docs/performance.md), so replicas that agree on NaN are not a silent
    "in sync". Without it NaN/inf are counted on diverged tensors only."""

    check_batches: bool = False
    """At each audited step, compare a digest of every rank's batch (recorded with
    ``Auditor.record_batch``): ranks that trained on identical batches are named in the record's notes."""
    attribution: AttributionConfig | None = None
    """Per-step records that name the corrupted rank and tell the machine from the software
    (:mod:`weightsync_audit.engine.attribution`); None: the vote alone, and a tie names no one."""

    def __post_init__(self) -> None:
        self.include = check_include(self.include)
        self.exclude = check_exclude(self.exclude)
        self.timeout_s = check_seconds(self.timeout_s, "timeout_s")
        if self.method not in get_args(Method):
            raise ValueError(f"method={self.method!r}: choose from {list(get_args(Method))}")
        check_count(self.slices, "slices", 1)
        check_count(self.pinpoint_slices, "pinpoint_slices", 1)
        check_seconds(self.gap_budget_s, "gap_budget_s", optional=False)
        self.tolerance = check_tolerance(self.tolerance)
        if isinstance(self.pinpoint_ring, bool) or not isinstance(self.pinpoint_ring, int) or self.pinpoint_ring < 1:
            raise ValueError(
                f"pinpoint_ring={self.pinpoint_ring!r}: must be an integer >= 1 (steps kept between audits)"
            )
        check_count(self.max_diff_tensors, "max_diff_tensors")
        check_count(self.max_diff_bytes, "max_diff_bytes")
        for flag in ("compare_broadcast_buffers", "pinpoint", "check_finite"):
            setattr(self, flag, check_flag(getattr(self, flag), flag))
        if self.ddp_broadcast_buffers is not None:
            self.ddp_broadcast_buffers = check_flag(self.ddp_broadcast_buffers, "ddp_broadcast_buffers")
        if self.attribution is not None and not isinstance(self.attribution, AttributionConfig):
            raise TypeError(f"attribution={self.attribution!r}: must be an AttributionConfig or None")

    def fingerprint(self) -> str:
        # Every setting that changes which messages an audit sends: ranks must agree on all of them.
        text = f"include={','.join(self.include)} exclude={','.join(self.exclude)} coverage=1/{self.slices} method={self.method}"
        if self.tolerance is not None:
            text += f" tolerance={self.tolerance!r}"
        if self.pinpoint:
            text += " pinpoint=on"
        if self.check_finite:
            text += " check_finite=on"
        if self.check_batches:
            text += " check_batches=on"
        if self.attribution is not None:
            text += self.attribution.fingerprint()
        return text
