"""How to audit: one :class:`AuditConfig`, validated once, taken by :func:`~weightsync_audit.audit`,
:class:`~weightsync_audit.Auditor` and every callback.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Mapping, TypeVar, get_args

from torch import nn

from weightsync_audit.engine.attribution import AttributionConfig
from weightsync_audit.engine.inventory.layouts import stage_module
from weightsync_audit.engine.inventory.manifest import check_include
from weightsync_audit.engine.measure.gaps import check_tolerance

__all__ = [
    "AuditConfig",
    "AuditRequest",
    "Method",
    "OnMismatch",
    "CADENCE_NAMES",
    "check_count",
    "check_exclude",
    "check_flag",
    "check_module",
    "check_on_mismatch",
    "check_seconds",
    "checked_options",
    "parse_coverage",
    "refuse_flat_beside",
    "with_checked_options",
]

Method = Literal["auto", "xxh3", "device"]
"""``auto``: xxh3 on CPU and on-device digests on accelerators; ``xxh3``; ``device``."""

OnMismatch = Literal["warn", "raise", "resync"]
"""What a callback does when ranks disagree: report, raise on every rank together, or repair and confirm."""


#: Each framework's name for the audit cadence: a name meant for another entry point is answered with this one's.
CADENCE_NAMES = {
    "every_n_train_steps": "the Lightning callback's (WeightSyncAudit), after Lightning's own",
    "every_n_steps": "the Hugging Face callback's, LoopAudit's and TorchFTAudit's, after TrainingArguments' logging_steps",
}

_ADAPTER_ONLY = {
    "check_batches": "check_batches is LoopAudit's and the Lightning callback's (WeightSyncAudit): the Hugging "
    "Face Trainer hands its callbacks no batch to compare",
}
"""Options some entry points cannot take, with the reason (the unknown-option error says it)."""

_NOT_OPTIONS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def checked_options(owner: Callable[..., Any], given: Mapping[str, Any], name: str | None = None) -> None:
    """Every entry point's answer to a keyword it does not take (``given`` holds the keywords): the option meant,
    the other framework's cadence name answered with this one's, a typo with its closest option
    (``TypeError``, as Python's own, with the suggestion). ``name``: the entry point as the user wrote it.

    >>> def f(every_n_steps: int = 1, report_path: str = "") -> None: ...
    >>> checked_options(f, {"every_n_train_steps": 5})
    Traceback (most recent call last):
    TypeError: f() got an unexpected option every_n_train_steps=5: did you mean every_n_steps=5? (every_n_train_steps is the Lightning callback's (WeightSyncAudit), after Lightning's own)
    """
    params = inspect.signature(owner).parameters
    known = [n for n, p in params.items() if p.kind not in _NOT_OPTIONS and n != "self"]
    unknown = [k for k in given if k not in known]
    if not unknown:
        return
    import difflib

    given_name, value = unknown[0], given[unknown[0]]
    cadence = next((c for c in CADENCE_NAMES if c in known), None)
    if given_name in _ADAPTER_ONLY:
        suggestion = _ADAPTER_ONLY[given_name]
    elif given_name in CADENCE_NAMES and cadence is not None:
        suggestion = f"did you mean {cadence}={value!r}? ({given_name} is {CADENCE_NAMES[given_name]})"
    else:
        close = difflib.get_close_matches(given_name, known, n=1, cutoff=0.6)
        suggestion = f"did you mean {close[0]}={value!r}?" if close else f"the options are {', '.join(known)}"
    what = name or getattr(owner, "__qualname__", str(owner)).removesuffix(".__init__")
    raise TypeError(f"{what}() got an unexpected option {given_name}={value!r}: {suggestion}")


T = TypeVar("T")


def with_checked_options(target: T) -> T:
    """A class (its constructor) or a function whose misspelt keyword is answered by :func:`checked_options`.

    >>> @with_checked_options
    ... def run(step: int = 0, *, tolerance: float | None = None) -> None: ...
    >>> run(tolerence=0.1)
    Traceback (most recent call last):
    TypeError: run() got an unexpected option tolerence=0.1: did you mean tolerance=0.1?
    """
    is_class = isinstance(target, type)
    fn: Callable[..., Any] = target.__init__ if is_class else target  # type: ignore[assignment, misc]
    known = frozenset(inspect.signature(fn).parameters)
    name = target.__name__ if is_class else fn.__qualname__  # type: ignore[attr-defined]

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if not known.issuperset(kwargs):
            checked_options(fn, kwargs, name)
        return fn(*args, **kwargs)

    if not is_class:
        return checked  # type: ignore[return-value]
    target.__init__ = checked  # type: ignore[misc]
    return target


def refuse_flat_beside(
    owner: Callable[..., Any], arguments: Mapping[str, Any], whole: str, skip: tuple[str, ...] = ()
) -> None:
    """Flat settings given beside ``whole=``, the object that holds every setting, are refused (one of the two
    would be silently ignored): a ``TypeError`` naming each of ``owner``'s keywords in ``arguments`` (a call's
    ``locals()``) set away from its default, but ``skip`` (the arguments that are no setting).

    >>> def f(config: object = None, tolerance: float | None = None, pinpoint: bool = False) -> None: ...
    >>> refuse_flat_beside(f, {"config": AuditConfig(), "tolerance": 0.1, "pinpoint": True}, "config")
    Traceback (most recent call last):
    TypeError: config= and tolerance=, pinpoint= both given: set them in the AuditConfig, or give the flat settings alone
    """
    given = [
        n
        for n, p in inspect.signature(owner).parameters.items()
        if n in arguments and n not in (whole, "self", *skip) and p.default is not inspect.Parameter.empty
        and arguments[n] is not p.default and arguments[n] != p.default
    ]  # fmt: skip
    if given:
        kind, them = type(arguments[whole]).__name__, given[0] if len(given) == 1 else "them"
        raise TypeError(
            f"{whole}= and {', '.join(n + '=' for n in given)} both given: set {them} in the {kind}, "
            "or give the flat settings alone"
        )


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


def check_count(value: object, argument: str, least: int = 0, what: str = "") -> int:
    """A whole number ``>= least``, else a ``ValueError`` naming ``argument`` (and ``what`` it counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{argument}={value!r}: must be an integer >= {least}" + (f" ({what})" if what else ""))
    return value


def check_module(module: object, argument: str = "module") -> Any:
    """The model to audit: a ``torch.nn.Module`` (or its DDP wrapper, or a pipelining stage), else a ``TypeError``
    naming ``argument`` (at construction, not at the first audit).

    >>> check_module(None)
    Traceback (most recent call last):
    TypeError: module=None: give the model to audit (a torch.nn.Module, or its DDP wrapper)
    """
    if module is None or not isinstance(stage_module(module), nn.Module):
        what = "None" if module is None else f" a {type(module).__name__}"
        raise TypeError(f"{argument}={what}: give the model to audit (a torch.nn.Module, or its DDP wrapper)")
    return module


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


@with_checked_options
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
        check_count(self.pinpoint_ring, "pinpoint_ring", 1, "steps kept between audits")
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


@dataclass(frozen=True, slots=True)
class AuditRequest:
    """What one audit covers beside the run's settings: one auditor serves every audit of a run (the weights
    after a step, the gradients before it, the full audit that confirms a repair).

    >>> base = AuditConfig(slices=4, pinpoint=True)
    >>> cfg = AuditRequest(include=("grads",), full=True, counted=False).config(base)
    >>> cfg.include, cfg.slices, cfg.pinpoint
    (('grads',), 1, False)
    """

    include: tuple[str, ...] | None = None
    """The kinds compared (``None``: the config's)."""
    exclude: tuple[str, ...] | None = None
    """The names left out (``None``: the config's), e.g. a DiLoCo sync's fragments other than the one synced."""
    full: bool = False
    """Every byte this once, whatever ``coverage`` says."""
    counted: bool = True
    """Entered in the run's history and read with its per-step evidence (pinpoint's ring, attribution's
    records, the batches, the step's hyper-parameters); ``False``: an audit beside the run's own (the
    gradients before a step, a repair's confirmation), with a history of its own, blamed from attribution's
    records without consuming them."""
    before_step: bool = False
    """Right before an optimizer step (the gradients' audit): attribution's record of that step is read too."""

    def __post_init__(self) -> None:
        if self.include is not None:
            object.__setattr__(self, "include", check_include(self.include))
        object.__setattr__(self, "full", check_flag(self.full, "full"))
        object.__setattr__(self, "counted", check_flag(self.counted, "counted"))
        object.__setattr__(self, "before_step", check_flag(self.before_step, "before_step"))

    def config(self, base: AuditConfig) -> AuditConfig:
        """``base`` as this audit reads it."""
        changes: dict[str, object] = {} if self.include is None else {"include": self.include}
        if self.exclude is not None:
            changes["exclude"] = tuple(self.exclude)
        if self.full:
            changes["slices"] = 1
        if not self.counted:
            changes.update(pinpoint=False, check_batches=False)
        return replace(base, **changes) if changes else base  # type: ignore[arg-type]
