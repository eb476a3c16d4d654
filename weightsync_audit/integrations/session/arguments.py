"""The adapters' own arguments, checked at construction: the cadence, the module and the exit code (an
unknown keyword: :func:`~weightsync_audit.engine.config.checked_options`).

>>> check_every_n(50, "every_n_steps")
50
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "EXIT_DIVERGED",
    "check_every_n",
    "check_exit_code",
    "check_module",
]

EXIT_DIVERGED = 17
"""The suggested ``exit_code``: the replicas diverged; restart from the last verified checkpoint."""


def check_every_n(value: object, argument: str) -> Optional[int]:
    """Validate an audit cadence (``every_n_train_steps``, ``every_n_steps``): an integer >= 1 or ``None``.

    >>> check_every_n(50, "every_n_steps")
    50
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{argument}={value!r}: must be an integer >= 1, or None to turn the cadence off")
    return value


def check_module(module: object, argument: str = "module") -> Any:
    """The model a plain loop audits: a ``torch.nn.Module`` (or its DDP wrapper, or a pipelining stage), else a
    ``TypeError`` naming ``argument`` (at construction, not at the first step).

    >>> check_module(None)
    Traceback (most recent call last):
    TypeError: module=None: give the model to audit (a torch.nn.Module, or its DDP wrapper)
    """
    from torch import nn

    from weightsync_audit.engine.inventory.replicas import stage_module

    if module is None:
        raise TypeError(f"{argument}=None: give the model to audit (a torch.nn.Module, or its DDP wrapper)")
    if not isinstance(stage_module(module), nn.Module):
        raise TypeError(
            f"{argument}= a {type(module).__name__}: give the model to audit (a torch.nn.Module, or its DDP wrapper)"
        )
    return module


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
