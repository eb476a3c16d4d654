"""Which engine wrapper an optimizer came in (a DeepSpeed ZeRO optimizer hands over its inner one).

:func:`~weightsync_audit.engine.inventory.manifest.as_optimizers` unwraps ``engine.optimizer`` to the
``torch.optim.Optimizer`` inside it; the replica adapters still need the wrapper (its ZeRO stage, its
partitions), so the unwrapping remembers it here, weakly (nothing is kept alive by the audit).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

__all__ = ["remember_wrapper", "stepping_optimizer", "unwrap_optimizer", "wrapper_of"]

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


def unwrap_optimizer(opt: Any) -> Any:
    """The ``torch.optim.Optimizer`` to audit inside ``opt``.

    A torch optimizer is itself (an Accelerate ``AcceleratedOptimizer`` over a torch one too). Below a link
    that is no torch optimizer (a DeepSpeed ZeRO optimizer, reached directly or through Lightning's or
    Accelerate's wrappers), the innermost torch optimizer is audited and that link is remembered.
    """
    import torch

    chain = _chain(opt)
    engine = next((i for i, o in enumerate(chain) if not isinstance(o, torch.optim.Optimizer)), None)
    if engine is None:
        return opt
    below = [o for o in chain[engine + 1 :] if isinstance(o, torch.optim.Optimizer)]
    if not below:
        return opt
    last_engine = max(i for i, o in enumerate(chain) if not isinstance(o, torch.optim.Optimizer))
    remember_wrapper(below[-1], chain[last_engine])
    return below[-1]


def stepping_optimizer(opt: Any) -> Any:
    """The torch optimizer whose ``step`` runs inside ``opt``'s: ``opt`` itself, or, below a wrapper that
    subclasses ``torch.optim.Optimizer`` without its constructor (Accelerate's ``AcceleratedOptimizer``,
    which holds no step hooks of its own), the innermost torch optimizer it steps.

    >>> import torch
    >>> sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    >>> stepping_optimizer(sgd) is sgd
    True
    """
    import torch

    if hasattr(opt, "_optimizer_step_pre_hooks"):
        return opt
    torch_ones = list(itertools.takewhile(lambda o: isinstance(o, torch.optim.Optimizer), _chain(opt)[1:]))
    return torch_ones[-1] if torch_ones else opt


def _chain(opt: Any) -> list[Any]:
    """``opt`` and the optimizers it wraps (``.optimizer``, link after link; at most 6, never a cycle)."""
    chain = [opt]
    while len(chain) < 6:
        inner = getattr(chain[-1], "optimizer", None)
        if inner is None or any(inner is c for c in chain):
            break
        chain.append(inner)
    return chain
