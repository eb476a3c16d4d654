"""Which engine wrapper an optimizer came in (a DeepSpeed ZeRO optimizer hands over its inner one).

:func:`~weightsync_audit.engine.inventory.manifest.as_optimizers` unwraps ``engine.optimizer`` to the
``torch.optim.Optimizer`` inside it; the replica adapters still need the wrapper (its ZeRO stage, its
partitions), so the unwrapping remembers it here, weakly (nothing is kept alive by the audit).
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["remember_wrapper", "wrapper_of"]

_WRAPPERS: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def remember_wrapper(inner: Any, wrapper: Any) -> None:
    """Note that ``inner`` was reached through ``wrapper`` (both weakly; unweakrefable ones are skipped)."""
    try:
        _WRAPPERS[inner] = weakref.ref(wrapper)
    except TypeError:
        pass


def wrapper_of(inner: Any) -> Any:
    """The wrapper ``inner`` was last reached through, or ``None``."""
    try:
        ref = _WRAPPERS.get(inner)
    except TypeError:
        return None
    return ref() if ref is not None else None
