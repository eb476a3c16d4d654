"""The ``WEIGHTSYNC_AUDIT`` variable's name, and what a callback it added says when it steps aside.

A leaf of the integrations: the Lightning callback, the Hugging Face callback and
:mod:`~weightsync_audit.integrations.activation` all read it, and it imports none of them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ENV_VAR", "dropped_message"]

ENV_VAR = "WEIGHTSYNC_AUDIT"


def dropped_message(callback: Any, own: str) -> str:
    """What the callback the variable added says when it steps aside for ``own`` (the explicit callback's
    class name): the options of the variable that are not used, by name.

    >>> class C: env_options = {"every_n_train_steps": 1, "report_path": "a.jsonl"}
    >>> dropped_message(C(), "WeightSyncAudit")  # doctest: +ELLIPSIS
    "...WeightSyncAudit passed in callbacks=..., so the one WEIGHTSYNC_AUDIT adds is not used: its options every_n_train_steps=1, report_path='a.jsonl' are dropped..."
    """
    options = getattr(callback, "env_options", None) or {}
    text = (
        f"weightsync audit: the Trainer already has a {own} passed in callbacks=[...], "
        f"so the one {ENV_VAR} adds is not used"
    )
    if not options:
        return text + " (it had no options)"
    given = ", ".join(f"{k}={v!r}" for k, v in options.items())
    return text + f": its options {given} are dropped (pass them to your callback to have them)"
