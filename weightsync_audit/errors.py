"""Every exception the library raises, in one flat module that imports nothing of the package."""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any, Sequence

__all__ = [
    "WeightSyncAuditError",
    "WeightDivergenceError",
    "AuditTimeoutError",
    "AuditOutOfStepError",
    "AuditPreparationError",
    "UnauditableTensorError",
    "ReportFormatError",
    "ReportReadError",
    "CheckpointError",
    "UnsafeCheckpointError",
    "WeightSyncWarning",
    "TrainableSetMismatchError",
    "ResyncError",
    "AuditRaceError",
    "user_stacklevel",
    "warn_user",
]


class WeightSyncAuditError(Exception):
    """Base class of the library's own errors.

    Every subclass pickles and unpickles with its fields (``__reduce__`` rebuilds it from its own
    constructor's arguments): an error raised in a spawned rank, a multiprocessing or a Ray worker reaches
    the parent whole.
    """

    def _init_args(self) -> tuple[Any, ...]:
        """The constructor arguments that rebuild this error, read from its own ``__init__``'s signature: each
        parameter is the attribute of the same name, ``message`` the message (a class without its own
        ``__init__``: its ``args``). One rule for every subclass, so a new field cannot be forgotten."""
        init = type(self).__init__
        if not inspect.isfunction(init):
            return tuple(self.args)
        params = list(inspect.signature(init).parameters.values())[1:]
        plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if any(p.kind not in plain or (p.name != "message" and not hasattr(self, p.name)) for p in params):
            return tuple(self.args)  # a signature that does not name its fields (a user's subclass)
        return tuple(str(self) if p.name == "message" else getattr(self, p.name) for p in params)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._init_args(), dict(self.__dict__))


class WeightDivergenceError(WeightSyncAuditError, RuntimeError):
    """Replicas hold different weights; raised on every rank at the same point.

    ``.result`` is the :class:`~weightsync_audit.AuditResult` that found it (typed ``Any`` here so that
    this module imports nothing of the package).
    """

    def __init__(self, result: Any, message: str | None = None) -> None:
        self.result = result
        if message is None:
            message = result.divergence_message()
        super().__init__(message)


class AuditTimeoutError(WeightSyncAuditError, RuntimeError):
    """A rank did not reach the audit within ``timeout_s``.

    ``.missing_ranks`` lists the ranks that did not arrive (as far as this rank can tell).
    """

    def __init__(self, message: str, missing_ranks: Sequence[int] = ()) -> None:
        self.missing_ranks = list(missing_ranks)
        super().__init__(message)


class AuditOutOfStepError(WeightSyncAuditError, RuntimeError):
    """Ranks reached the audit at different steps, hooks or with different settings.

    Every rank raises it together; ``.positions`` maps each rank to where it was.
    """

    def __init__(self, message: str, positions: dict[int, str] | None = None) -> None:
        self.positions = dict(positions or {})
        super().__init__(message)


class UnauditableTensorError(WeightSyncAuditError, TypeError):
    """A tensor (named in the message and ``.name``) cannot be audited; ``.why`` says why."""

    def __init__(self, name: str, why: str) -> None:
        self.name = name
        self.why = why
        super().__init__(f"cannot audit {name!r}: {why}")


class ReportFormatError(WeightSyncAuditError, ValueError):
    """A report line is not a valid record; ``.line`` is its 1-based number."""

    def __init__(self, message: str, line: int | None = None, torn: bool = False) -> None:
        self.line = line
        self.torn = torn
        super().__init__(message)


class ReportReadError(WeightSyncAuditError, ValueError):
    """A report cannot be read at all (no such file, a folder, binary data); the message is one line."""


class CheckpointError(WeightSyncAuditError, ValueError):
    """A checkpoint (or its sidecar) could not be read; the message says which file and why."""


class UnsafeCheckpointError(CheckpointError):
    """A file that needs code to load; it was refused and nothing in it was executed."""


class WeightSyncWarning(UserWarning):
    """Something will make replicas drift, or an audit could not be done as asked."""


class AuditPreparationError(WeightSyncAuditError, RuntimeError):
    """Another rank could not prepare its audit (its own error is raised there); raised on the others.

    ``.failures`` maps each failed rank to its error message.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        self.failures = dict(failures or {})
        super().__init__(message)


class AuditRaceError(WeightSyncAuditError, RuntimeError):
    """An overlapped audit's tensors were written while it read them (outside the optimizer, whose step
    waits for the audit): the step is not compared half-updated. Raised on every rank together;
    ``.raced`` maps each rank that saw a write to what it saw."""

    def __init__(self, message: str, raced: dict[int, str] | None = None) -> None:
        self.raced = dict(raced or {})
        super().__init__(message)


class TrainableSetMismatchError(WeightSyncAuditError, RuntimeError):
    """Ranks hold different trainable sets where they must agree (before re-wrapping DDP); raised on every rank.

    ``.ranks`` lists the ranks whose flags differ from the majority's.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        self.ranks = list(ranks)
        super().__init__(message)


class ResyncError(WeightSyncAuditError, RuntimeError):
    """``resync`` could not finish: a rank (named in the message and ``.failed_rank``) died, stopped or
    lost its connection while tensors were moving.

    ``.partial`` lists this rank's tensors that may hold a mix of old and new values; ``.untouched``
    the ones not written at all. Call ``resync`` again (or restore a checkpoint) before training on.
    """

    def __init__(
        self, message: str, failed_rank: int | None, partial: Sequence[str] = (), untouched: Sequence[str] = ()
    ) -> None:
        self.failed_rank = failed_rank
        self.partial = list(partial)
        self.untouched = list(untouched)
        super().__init__(message)


#: Packages whose frames a warning is not attributed to: this one and the frameworks that call it.
_NOT_USER_CODE = ("weightsync_audit", "pytorch_lightning", "lightning", "lightning_fabric", "transformers")
_NOT_USER_CODE += ("accelerate", "torch")


def user_stacklevel() -> int:
    """The ``stacklevel`` that attributes a warning to the user's line (``trainer.fit(...)``, the training
    loop), not to a framework's dispatch (``pytorch_lightning/trainer/call.py``); call it as the argument
    of ``warnings.warn``. Where no user line is on the stack (a rank forked or spawned by a launcher), the
    outermost frame of this package: the callback's hook.

    >>> import warnings
    >>> def deep() -> None:
    ...     warnings.warn("x", stacklevel=user_stacklevel())
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     deep()
    >>> seen[0].filename.endswith("errors.py")
    False
    """
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    frame = sys._getframe(1)  # the function that calls warnings.warn: stacklevel 1
    level, ours = 1, 1
    while frame is not None:
        package = str(frame.f_globals.get("__name__", "")).split(".")[0]
        if package == "weightsync_audit":
            ours = level
        elif package not in _NOT_USER_CODE and not frame.f_code.co_filename.startswith(stdlib):
            return level
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return ours


def warn_user(message: str) -> None:
    """Warn ``message`` as a :class:`WeightSyncWarning` attributed to the user's line (:func:`user_stacklevel`)."""
    warnings.warn(message, WeightSyncWarning, stacklevel=user_stacklevel())
