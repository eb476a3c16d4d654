"""Zero-code activation: ``WEIGHTSYNC_AUDIT`` adds the callback to every Trainer in the environment.

Lightning calls the factories registered under its ``callbacks_factory`` entry points when a Trainer
is built. Unset (or ``0``), nothing happens. ``1`` adds ``WeightSyncAudit()`` with its defaults;
``every_n_train_steps=50,on_mismatch=raise,report_path=audit.jsonl`` sets options. A bad option fails
the Trainer's construction with a message naming it.

Lists use ``+`` inside one option: ``hooks=on_train_start+on_fit_end``; ``none`` means ``None``.

A Trainer that already has its own audit callback (passed in ``callbacks=``) keeps it: the one the
variable added steps aside and says so, naming the options of the variable that are therefore dropped
(:func:`dropped_message`). The Hugging Face Trainer has no entry point for callbacks: there the same
variable is read by ``WeightSyncAuditCallback.from_env()``, which an import hook adds to every Trainer
(:mod:`~weightsync_audit.integrations.hf_activation`, installed by a ``.pth`` line at start-up) and which
takes the same options (``every_n_train_steps`` is its ``every_n_steps``).
"""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any, Sequence

from weightsync_audit.integrations.lightning.audit_callback import WeightSyncAuditMixin
from weightsync_audit.text import ENV_VAR, dropped_message

__all__ = [
    "ENV_VAR",
    "callbacks_from_env",
    "dropped_message",
    "parse_options",
    "pytorch_lightning_callbacks",
    "lightning_pytorch_callbacks",
    "option_names",
]


_OFF = ("", "0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")
_LISTS = ("hooks", "include", "exclude")


def option_names(init: Any) -> list[str]:
    """The options a callback's ``__init__`` takes by name (not ``self``, ``options`` or its ``**unknown``)."""
    params = inspect.signature(init).parameters.values()
    return [p.name for p in params if p.name not in ("self", "options") and p.kind is not p.VAR_KEYWORD]


def _convert(key: str, text: str) -> Any:
    if key in _LISTS:
        return tuple(v for v in text.split("+") if v)
    if text.lower() == "none":
        return None
    if key == "resync_src" and text == "majority":
        return text
    if key in ("every_n_train_steps", "every_n_steps", "resync_src", "pinpoint_ring", "exit_code"):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{ENV_VAR}: option {key}={text!r} must be an integer") from None
    if key in ("timeout_s", "tolerance"):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{ENV_VAR}: option {key}={text!r} must be a number") from None
    if key in ("verbose", "pinpoint", "checkpoints", "overlap", "attribution"):
        if text.lower() not in _ON + _OFF:
            raise ValueError(f"{ENV_VAR}: option {key}={text!r} must be true or false")
        return text.lower() in _ON
    return text


def _unknown(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"{ENV_VAR}: unknown option {key!r}: {hint}(options: {', '.join(known)})"


def parse_options(value: str | None, names: Sequence[str] | None = None) -> dict[str, Any] | None:
    """The callback's keyword arguments from the variable's value; ``None`` when it is off.

    ``names``: the options accepted (default: the Lightning callback's).

    >>> parse_options("every_n_train_steps=50,on_mismatch=raise")
    {'every_n_train_steps': 50, 'on_mismatch': 'raise'}
    >>> parse_options("0") is None
    True
    """
    if value is None or value.strip().lower() in _OFF:
        return None
    text = value.strip()
    if text.lower() in _ON:
        return {}
    known = list(names) if names is not None else option_names(WeightSyncAuditMixin.__init__)
    out: dict[str, Any] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"{ENV_VAR}: {part!r} is not key=value (options: {', '.join(known)})")
        if key not in known:
            raise ValueError(_unknown(key, known))
        out[key] = _convert(key, raw.strip())
    return out


def callbacks_from_env(
    cls: type, names: Sequence[str] | None = None, rename: dict[str, str] | None = None
) -> list[Any]:
    """``[cls(**options)]`` from the variable, or ``[]`` when it is off; the callback keeps the options
    given (``env_options``). ``rename`` maps another callback's option names to
    ``cls``'s (the Lightning cadence to the Hugging Face one)."""
    value = os.environ.get(ENV_VAR)
    rename = rename or {}
    options = parse_options(value, None if names is None else [*names, *rename])
    if options is None:
        return []
    options = {rename.get(k, k): v for k, v in options.items()}
    try:
        callback = cls(**options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{ENV_VAR}={value!r}: {exc}") from None
    callback.env_options = options
    return [callback]


def pytorch_lightning_callbacks() -> list[Any]:
    """Entry point for ``pytorch_lightning.callbacks_factory``."""
    from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit

    return callbacks_from_env(WeightSyncAudit)  # each keeps env_options: from_env reads them


def lightning_pytorch_callbacks() -> list[Any]:
    """Entry point for ``lightning.pytorch.callbacks_factory``."""
    from weightsync_audit.lightning.lightning_pytorch import WeightSyncAudit

    return callbacks_from_env(WeightSyncAudit)  # each keeps env_options: from_env reads them
