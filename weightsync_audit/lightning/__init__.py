"""The import path Lightning users write: ``weightsync_audit.lightning.pytorch_lightning`` for
``import pytorch_lightning`` and ``weightsync_audit.lightning.lightning_pytorch`` for ``import lightning.pytorch``
(one class per namespace over the Lightning-free mixins of :mod:`weightsync_audit.integrations.lightning`).

Lightning is an extra: without it, importing a callback says what to install.
"""

from __future__ import annotations

import importlib

__all__ = ["callback_base", "callback_classes"]

_INSTALL = {
    "pytorch_lightning": (
        "pytorch-lightning",
        "pip install 'weightsync-audit[lightning]' (in a checkout: pip install -e '.[lightning]')",
    ),
    "lightning": ("lightning", "pip install lightning (or, for import pytorch_lightning: the lightning extra)"),
}


def callback_base(namespace: str) -> type:
    """Lightning's ``Callback`` in ``namespace`` (``pytorch_lightning`` or ``lightning.pytorch``); where that
    Lightning is not installed, a ``ModuleNotFoundError`` that says what to install.

    >>> callback_base("pytorch_lightning").__name__
    'Callback'
    """
    package = namespace.split(".")[0]
    try:
        return importlib.import_module(namespace).Callback
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != package:
            raise  # Lightning is there, something it imports is not: its own error says what
        wheel, install = _INSTALL[package]
        raise ModuleNotFoundError(
            f"weightsync_audit's Lightning callbacks for `import {namespace}` need {wheel}, which is not "
            f"installed: {install}",
            name=exc.name,
        ) from None


def callback_classes(namespace: str, module: str) -> tuple[type, type]:
    """``WeightSyncAudit`` and ``DDPRewrapOnTrainableChange`` over ``namespace``'s ``Callback`` (one class per
    namespace, each a Lightning-free mixin and that base), defined as ``module``'s own: a callback pickles to a
    ``ddp_spawn`` worker by that name."""
    from weightsync_audit.integrations.lightning.audit_callback import WeightSyncAuditMixin
    from weightsync_audit.integrations.lightning.rewrap_callback import DDPRewrapMixin

    base = callback_base(namespace)
    return tuple(  # type: ignore[return-value]
        type(name, (mixin, base), {"__doc__": mixin.__doc__, "__module__": module, "__qualname__": name})
        for name, mixin in (("WeightSyncAudit", WeightSyncAuditMixin), ("DDPRewrapOnTrainableChange", DDPRewrapMixin))
    )
