"""The adapters' own arguments, checked at construction: the cadence, the exit code, and an unknown
keyword answered with the option meant (the other framework's cadence name, or the closest option).

>>> check_every_n(50, "every_n_steps")
50
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = [
    "CADENCE_NAMES",
    "EXIT_DIVERGED",
    "check_every_n",
    "check_exit_code",
    "check_module",
    "reject_unknown_options",
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


#: Each framework's name for the audit cadence: a name meant for another callback is answered with this one's.
CADENCE_NAMES = {
    "every_n_train_steps": "the Lightning callback's (WeightSyncAudit), after Lightning's own",
    "every_n_steps": "the Hugging Face callback's and LoopAudit's, after TrainingArguments' logging_steps",
}


_ADAPTER_ONLY = {
    "check_batches": "check_batches is LoopAudit's and the Lightning callback's (WeightSyncAudit): the Hugging "
    "Face Trainer hands its callbacks no batch to compare",
}
"""Options some adapters cannot take, with the reason (the unknown-option error says it)."""


def reject_unknown_options(
    owner: Callable[..., Any], unknown: dict[str, Any], cadence: str, name: str | None = None
) -> None:
    """Answer an unknown keyword with the option meant: the other framework's cadence name gets this
    callback's, a typo its closest option (``TypeError``, as Python's own, with the suggestion).

    >>> def f(every_n_steps: int = 1, report_path: str = "") -> None: ...
    >>> reject_unknown_options(f, {"every_n_train_steps": 5}, "every_n_steps")
    Traceback (most recent call last):
    TypeError: f() got an unexpected option every_n_train_steps=5: did you mean every_n_steps=5? (every_n_train_steps is the Lightning callback's (WeightSyncAudit), after Lightning's own)
    """
    if not unknown:
        return
    import difflib
    import inspect

    known = [n for n in inspect.signature(owner).parameters if n not in ("self", "args", "kwargs", "unknown")]
    given, value = next(iter(unknown.items()))
    if given in _ADAPTER_ONLY and given not in known:
        suggestion = _ADAPTER_ONLY[given]
    elif given in CADENCE_NAMES and given != cadence:
        suggestion = f"did you mean {cadence}={value!r}? ({given} is {CADENCE_NAMES[given]})"
    else:
        close = difflib.get_close_matches(given, known, n=1, cutoff=0.6)
        suggestion = f"did you mean {close[0]}={value!r}?" if close else f"the options are {', '.join(known)}"
    what = name or getattr(owner, "__qualname__", str(owner)).removesuffix(".__init__")
    raise TypeError(f"{what}() got an unexpected option {given}={value!r}: {suggestion}")


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
