"""The options every audit adapter shares, defined once: :class:`AuditOptions`; and the adapters' own
arguments, checked at construction (the cadence, the module; an unknown keyword:
:func:`~weightsync_audit.engine.config.checked_options`).

The runner (:class:`~weightsync_audit.integrations.session.runner.AuditRunner`) takes one whole; the Lightning
callback, the Hugging Face callback and :class:`~weightsync_audit.LoopAudit` keep their flat keyword
arguments (LightningCLI and the ``WEIGHTSYNC_AUDIT`` variable read those) and build one from them
(:meth:`AuditOptions.given`). A test checks that every adapter's flat signature lists these fields, with
these defaults, in this order.

>>> AuditOptions(on_mismatch="raise", exit_code=17).exit_code
17
>>> AuditOptions(coverage=0.3)
Traceback (most recent call last):
ValueError: coverage=0.3: must be 1/n for a whole number n, e.g. 1/8
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, TypeVar

from weightsync_audit.engine.attribution import AttributionConfig, check_attribution
from weightsync_audit.engine.config import (
    AuditConfig,
    OnMismatch,
    check_count,
    check_flag,
    check_on_mismatch,
    parse_coverage,
    refuse_flat_beside,
    with_checked_options,
)
from weightsync_audit.engine.repair.plan import ResyncSource, check_resync_src
from weightsync_audit.engine.timeline.pinpoint import DEFAULT_RING
from weightsync_audit.reporting.jsonl import RecordSink, RecordSinks, check_report_path

__all__ = [
    "EXIT_DIVERGED",
    "AuditKind",
    "AuditOptions",
    "check_every_n",
    "check_exit_code",
    "option_names",
    "with_option_properties",
]

EXIT_DIVERGED = 17
"""The suggested ``exit_code``: the replicas diverged; restart from the last verified checkpoint."""


def check_every_n(value: object, argument: str) -> Optional[int]:
    """Validate an audit cadence (``every_n_train_steps``, ``every_n_steps``): an integer >= 1 or ``None``.

    >>> check_every_n(50, "every_n_steps")
    50
    """
    return None if value is None else check_count(value, argument, 1, "or None to turn the cadence off")


def check_exit_code(value: object, on_mismatch: str) -> Optional[int]:
    """Validate ``exit_code``: ``None``, or an integer 1..255 together with ``on_mismatch="raise"``.

    >>> check_exit_code(17, "raise")
    17
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 255:
        raise ValueError(f"exit_code={value!r}: must be an integer from 1 to 255, or None")
    if on_mismatch != "raise":
        raise ValueError(f"exit_code={value!r} acts on a divergence under on_mismatch='raise', not {on_mismatch!r}")
    return value


AuditKind = Literal["params", "buffers", "optimizer", "grads"]
"""What an audit compares: parameters, buffers, optimizer state (and each group's hyper-parameters), gradients."""


@with_checked_options
@dataclass(kw_only=True, slots=True, frozen=True)
class AuditOptions:
    """How an adapter audits and what it does with a divergence; validated at construction, each error
    naming the argument. Every adapter (and its runner) takes one whole."""

    include: Sequence[AuditKind] = ("params", "buffers", "optimizer")
    """Kinds to audit: ``params``, ``buffers``, ``optimizer``, ``grads`` (gradients just before the step)."""
    exclude: Sequence[str] = ()
    """Glob patterns over names to leave out (``*.running_*``, ``head.*``)."""
    on_mismatch: OnMismatch = "warn"
    """``warn`` (report on the main process when a divergence appears or changes), ``raise``
    (``WeightDivergenceError`` on every rank at the same point), ``resync`` (broadcast the diverged tensors
    from ``resync_src``, then confirm with a full audit)."""
    resync_src: ResyncSource = 0
    """The rank whose values win in ``resync`` (for each tensor it holds the reference value of), or
    ``"majority"``: every tensor from a rank holding its reference value."""
    report_path: Optional[str] = None
    """JSONL file that the main process appends one record per audit to (a path-like is kept as ``str``)."""
    timeout_s: Optional[float] = 600.0
    """Deadline for the ranks to meet at an audit (``AuditTimeoutError`` names the missing); ``None``: none."""
    coverage: float | str = 1
    """``1`` for full audits, ``1/n`` for sampled audits that cover everything every n audits."""
    verbose: bool = True
    """Print a divergence and the run's summary on the main process."""
    tolerance: Optional[float] = None
    """Relative gap (``rel_diff``) under which a mismatch is kept as ``within_tolerance`` and not acted on."""
    pinpoint: bool = False
    """Digest the audited tensors after every optimizer step (local) so a divergent record names the step
    it began (``first_diverged_step``)."""
    pinpoint_ring: Optional[int] = None
    """Steps kept between audits (``None``: two audit intervals, and at least 1024)."""
    pinpoint_coverage: float | str = 1
    """``1/n``: each per-step digest hashes one n-th of every large tensor (n times cheaper)."""
    checkpoints: bool = True
    """Audit at every checkpoint the trainer saves and write a sidecar beside it; on resume, compare every
    rank with the sidecar before the first step (docs/restarts.md). The Trainer adapters' option."""
    exit_code: Optional[int] = None
    """With ``on_mismatch="raise"``: every rank ends its process with this status after the record is
    written (17 is the suggestion; docs/restarts.md)."""
    sinks: Sequence[RecordSink] = ()
    """Objects that the main process also hands each record to (``write(record)``; docs/metrics.md)."""
    attribution: bool | dict[str, Any] | AttributionConfig | None = False
    """Per-step records that name the corrupted rank and tell the machine from the software (``True``, or
    :class:`~weightsync_audit.AttributionConfig`'s fields as a dict; the record's ``blame``)."""
    overlap: bool = False
    """The audit right after an optimizer step runs on a worker thread while the next step's forward and
    backward run; its verdict is acted on before the next optimizer update (docs/performance.md)."""

    def __post_init__(self) -> None:
        for flag in ("verbose", "pinpoint", "checkpoints"):
            object.__setattr__(self, flag, check_flag(getattr(self, flag), flag))
        if not isinstance(self.overlap, bool):
            raise TypeError(f"overlap={self.overlap!r}: must be True or False")
        config = self.audit_config()  # include, exclude, timeout_s, coverage, tolerance, pinpoint_ring
        on_mismatch = check_on_mismatch(self.on_mismatch)
        check_exit_code(self.exit_code, on_mismatch)
        check_resync_src(self.resync_src)
        if self.report_path is not None:
            check_report_path(self.report_path, "report_path")
            object.__setattr__(self, "report_path", os.fspath(self.report_path))
        object.__setattr__(self, "include", config.include)
        object.__setattr__(self, "exclude", config.exclude)
        object.__setattr__(self, "sinks", RecordSinks(self.sinks).sinks)

    def audit_config(self, every_n: int | None = None) -> AuditConfig:
        """The engine's :class:`~weightsync_audit.AuditConfig` for these options; ``every_n``: the adapter's
        cadence, which sizes the default pinpoint ring (two audit intervals of steps)."""
        return AuditConfig(
            include=self.include,  # type: ignore[arg-type]  # validated there: a str or any sequence
            exclude=self.exclude,  # type: ignore[arg-type]
            timeout_s=self.timeout_s,
            slices=parse_coverage(self.coverage),
            tolerance=self.tolerance,
            pinpoint=bool(self.pinpoint),
            pinpoint_ring=max(DEFAULT_RING, 2 * (every_n or 0) + 16)
            if self.pinpoint_ring is None
            else self.pinpoint_ring,
            pinpoint_slices=parse_coverage(self.pinpoint_coverage, "pinpoint_coverage"),
            attribution=check_attribution(self.attribution),
        )

    @classmethod
    def given(cls, arguments: Mapping[str, Any], options: AuditOptions | None = None) -> AuditOptions:
        """The options of an adapter's flat keyword ``arguments`` (its ``locals()``; other names are
        ignored), or ``options`` whole when given, in which case no flat option may also be set."""
        flat = {f.name: arguments[f.name] for f in fields(cls) if f.name in arguments}
        if options is None:
            return cls(**flat)
        if not isinstance(options, cls):
            raise TypeError(f"options={options!r}: must be an AuditOptions")
        refuse_flat_beside(cls, {**flat, "options": options}, "options")
        return options


def option_names() -> tuple[str, ...]:
    """The fields of :class:`AuditOptions`, in order."""
    return tuple(f.name for f in fields(AuditOptions))


T = TypeVar("T")


def _option_property(name: str, settable: bool) -> property:
    def get(self: Any) -> Any:
        return getattr(self.options, name)

    def set_(self: Any, value: Any) -> None:
        self.options = replace(self.options, **{name: value})

    return property(get, set_ if settable else None, doc=f"The ``{name}`` of :attr:`options` (:class:`AuditOptions`).")


def with_option_properties(*, skip: Sequence[str] = (), settable: bool = False) -> Callable[[type[T]], type[T]]:
    """Class decorator: each :class:`AuditOptions` field (but ``skip``) as a property reading ``self.options``
    (``settable``: assigning one replaces the options, validated again), so ``callback.include`` reads the one
    definition."""

    def decorate(cls: type[T]) -> type[T]:
        for name in option_names():
            if name not in skip and name not in vars(cls):
                setattr(cls, name, _option_property(name, settable))
        return cls

    return decorate
