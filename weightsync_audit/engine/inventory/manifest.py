"""What is audited: an ordered manifest of named tensors taken from a module and its optimizers.

Names are always the user's own (``backbone.weight``), whatever wrapper the module arrives in.
Python values (learning rates, betas, integer steps) become small tensors so that one digest path
serves everything (a float by its exact float64 bits); ``None`` and other objects become a UTF-8 encoding
of their ``repr``. A list, tuple or dict that holds a tensor anywhere (LBFGS keeps ``old_dirs``,
``old_stps``, ``ro`` and ``al`` as lists of tensors; Adam accepts tensor ``betas``) is opened: each item
is an entry of its own, named by its path (``fc.weight.old_dirs.3``, ``param_groups.0.betas.1``), so a
tensor is always compared by its exact bytes, never by its printed (rounded, elided) ``repr``.

A parameter's trainable flag (``requires_grad``) is part of the structure (:attr:`Entry.frozen`); a
tensor whose storage no longer holds its view (freed or shrunk under it) is refused by name, never read.

An optimizer inside an engine's wrapper (a DeepSpeed ZeRO optimizer hands over its inner one) is audited as
the ``torch.optim.Optimizer`` inside it (:func:`unwrap_optimizer`); the replica adapters still need the
wrapper (its ZeRO stage, its partitions), so the unwrapping remembers it, weakly (:func:`wrapper_of`).
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import weakref
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from weightsync_audit.compat import is_dtensor, peel_wrapper
from weightsync_audit.engine.hashing.reader import readable
from weightsync_audit.engine.inventory.peers import ShardInfo, shard_info

__all__ = [
    "has_shards",
    "holds_tensor",
    "INCLUDE_CHOICES",
    "Entry",
    "Manifest",
    "build_manifest",
    "check_include",
    "named_tensors",
    "unwrap_module",
    "as_optimizers",
    "remember_wrapper",
    "stepping_optimizer",
    "before_update",
    "unwrap_optimizer",
    "wrapper_of",
]

#: ``include`` names and the record kind each one produces.
INCLUDE_CHOICES: dict[str, str] = {
    "params": "param",
    "buffers": "buffer",
    "optimizer": "optimizer",
    "grads": "grad",
}

#: Record kinds, in manifest order.
KINDS: tuple[str, ...] = ("param", "buffer", "optimizer", "grad")


@dataclass(slots=True)
class Entry:
    """One audited value."""

    name: str
    """The user's name: ``backbone.weight``, ``backbone.weight.exp_avg``, ``param_groups.0.lr``."""
    kind: str
    """``param``, ``buffer``, ``optimizer`` or ``grad``."""
    tensor: torch.Tensor
    """The value as a tensor (a Python value is converted, see the module docstring)."""
    dtype: str
    """``float32``...; ``none`` for ``None``; ``object`` for other Python objects."""
    shape: tuple[int, ...]
    """Logical shape (the global shape for a DTensor, whose ``tensor`` is the local shard)."""
    container: Any = None
    """Where a Python value lives (a dict), for resync to write it back; ``None`` for tensors."""
    key: Any = None
    """The key of the value in ``container``."""
    note: str | None = None
    """Anything the report should say about how the value was read."""
    shard: ShardInfo | None = None
    """For a DTensor: its layout, global shape, shard coordinates and peer key; ``None`` otherwise."""
    frozen: bool = False
    """A parameter that does not require grad (not trainable): part of the compared structure."""

    @property
    def uid(self) -> str:
        """Unique within a manifest: kind and name."""
        return f"{self.kind}:{self.name}"


@dataclass(slots=True)
class Manifest:
    """The ordered entries of one audit, plus what was skipped and why."""

    entries: list[Entry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    walked: tuple[nn.Module | None, Sequence[tuple[str, Any]]] = (None, ())
    """The model unwrapped and its named parameters, as the build walked them (the replica rules read them)."""

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for e in self.entries:
            out[e.kind] += 1
        return out


def check_include(include: Iterable[str], argument: str = "include") -> tuple[str, ...]:
    """Validate ``include`` kinds; return them in canonical order."""
    if isinstance(include, str):
        include = (include,)
    try:
        got = tuple(include)
    except TypeError:
        raise TypeError(f"{argument}={include!r}: give a tuple of kinds from {list(INCLUDE_CHOICES)}") from None
    unknown = [k for k in got if k not in INCLUDE_CHOICES]
    if unknown:
        raise ValueError(f"{argument}={got!r}: unknown kind(s) {unknown}; choose from {list(INCLUDE_CHOICES)}")
    if not got:
        raise ValueError(f"{argument}=(): nothing would be compared; choose kinds from {list(INCLUDE_CHOICES)}")
    return tuple(k for k in INCLUDE_CHOICES if k in got)


def unwrap_module(module: nn.Module) -> nn.Module:
    """Peel DistributedDataParallel, DataParallel, Fabric and ``torch.compile`` wrappers."""
    seen = 0
    while seen < 16:
        seen += 1
        inner = peel_wrapper(module)
        if inner is None:
            break
        module = inner
    return module


def as_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """Accept ``None``, one optimizer, a Lightning/Fabric wrapped one, a Megatron ``ChainedOptimizer``, or a
    sequence of them."""
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    # Megatron-core's get_megatron_optimizer returns a ChainedOptimizer (dense and expert optimizers).
    items = [o for item in items for o in (getattr(item, "chained_optimizers", None) or [item])]
    out = []
    for i, opt in enumerate(items):
        # LightningOptimizer / _FabricOptimizer / a DeepSpeed ZeRO optimizer (remembered for the replica rules)
        opt = unwrap_optimizer(opt)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer[{i}] is a {type(opt).__name__}, not a torch.optim.Optimizer")
        out.append(opt)
    return out


def _glob_excluded(name: str, exclude: Sequence[str]) -> bool:
    # Checked once per tensor per audit: skip building a generator when there is nothing to match.
    return bool(exclude) and any(fnmatch.fnmatchcase(name, pat) for pat in exclude)


_SCALARS: dict[tuple[type, Any], tuple[torch.Tensor, str]] = {}
"""Encoded scalars by type and value: an optimizer's hyper-parameters are re-read at every audit and
mostly unchanged, and making a tensor costs microseconds (nothing writes into these tensors)."""


def value_as_tensor(value: Any) -> tuple[torch.Tensor, str]:
    """Encode a Python value as a tensor and a dtype label, exactly (no rounding)."""
    kind = type(value)
    key: Any = None
    if kind is bool or kind is int or value is None or (kind is float and value):  # 0.0 == -0.0: never cached
        key = (kind, value)
    elif (kind is tuple or kind is list) and value and all(type(v) is float and v for v in value):  # betas
        key = (kind, tuple(value))
    if key is not None:
        hit = _SCALARS.get(key)
        if hit is None:
            if len(_SCALARS) > 4096:
                _SCALARS.clear()
            hit = _SCALARS[key] = _encode(value)
        return hit
    return _encode(value)


def _encode(value: Any) -> tuple[torch.Tensor, str]:
    if isinstance(value, bool):
        return torch.tensor(value, dtype=torch.bool), "bool"
    if isinstance(value, int) and -(2**63) <= value < 2**63:
        return torch.tensor(value, dtype=torch.int64), "int64"
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64), "float64"
    if (
        isinstance(value, (tuple, list))
        and value
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        and all(isinstance(v, float) or -(2**63) <= v < 2**63 for v in value)
    ):
        if all(isinstance(v, int) for v in value):
            return torch.tensor(value, dtype=torch.int64), "int64"
        return torch.tensor([float(v) for v in value], dtype=torch.float64), "float64"
    if value is None:
        return torch.empty(0, dtype=torch.uint8), "none"
    text = _canonical_repr(value).encode("utf-8", "backslashreplace")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8), "object"


def holds_tensor(value: Any, depth: int = 0) -> bool:
    """Whether a list, tuple or dict holds a tensor anywhere inside (it is then audited item by item)."""
    if depth > 8:
        return False
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return False
    return any(
        isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple, dict)) and holds_tensor(v, depth + 1))
        for v in value
    )


def _canonical_repr(value: Any) -> str:
    # repr of floats is exact in Python 3; dicts are ordered; sets are sorted so that ranks agree.
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_canonical_repr(v) for v in value)) + "}"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return repr(value)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    # str(dtype) costs over a microsecond: remembered, it is a dict look-up per tensor.
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _tensor_entry(
    name: str,
    kind: str,
    t: torch.Tensor,
    container: Any = None,
    key: Any = None,
) -> Entry:
    # A DTensor is compared among its peers only (engine/peers.py); the structure holds the global shape.
    shard = shard_info(t) if is_dtensor(t) else None
    t = readable(t, name)  # its local data, detached; what cannot be read refused by name
    shape = shard.shape if shard is not None else tuple(t.shape)
    return Entry(name, kind, t, dtype_name(t.dtype), shape, container, key, None, shard)


def _value_entries(out: list[Entry], name: str, kind: str, value: Any, container: Any, key: Any) -> None:
    """The entries of one optimizer value: one, or one per item of a container that holds a tensor."""
    if isinstance(value, torch.Tensor):
        out.append(_tensor_entry(name, kind, value, container, key))
        return
    if isinstance(value, (list, tuple, dict)) and holds_tensor(value):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            _value_entries(out, f"{name}.{k}", kind, v, value, k)
        return
    t, label = value_as_tensor(value)
    out.append(Entry(name, kind, t, label, tuple(t.shape) if label not in ("none", "object") else (), container, key))


def named_tensors(module: nn.Module, attr: str = "_parameters") -> list[tuple[str, Any]]:
    """``named_parameters()`` / ``named_buffers()`` with the same names and order, at half the cost.

    A tensor reached twice (tied weights, a shared module) appears once, under its first name, as with
    ``remove_duplicate=True``. Torch's own walk hashes every tensor through a Python ``__hash__``; here
    ``id()`` does, which is most of the per-tensor time on models of many small tensors.
    """
    seen: set[int] = set()
    out: list[tuple[str, Any]] = []
    for prefix, mod in module.named_modules():
        for key, value in getattr(mod, attr).items():
            if value is None or id(value) in seen:
                continue
            seen.add(id(value))
            out.append((f"{prefix}.{key}" if prefix else key, value))
    return out


def build_manifest(
    module: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    *,
    include: Sequence[str] = ("params", "buffers", "optimizer"),
    exclude: Sequence[str] = (),
    skip_buffers_reason: str | None = None,
) -> Manifest:
    """The ordered manifest of everything to audit.

    Order: params, buffers, optimizer state (per parameter, then per param group), grads.
    A DTensor contributes its local shard with its :class:`ShardInfo`; which ranks it is compared with
    is decided from the gathered peer keys.
    """
    manifest = Manifest()
    entries = manifest.entries
    user = unwrap_module(module) if module is not None else None
    named_params: list[tuple[str, nn.Parameter]] = named_tensors(user) if user is not None else []
    manifest.walked = (user, named_params)

    if "params" in include:
        for n, p in named_params:
            if not _glob_excluded(n, exclude):
                entries.append(_tensor_entry(n, "param", p))
                if not p.requires_grad:
                    entries[-1].frozen = True

    if "buffers" in include and user is not None:
        buffers = [(n, b) for n, b in named_tensors(user, "_buffers") if not _glob_excluded(n, exclude)]
        if skip_buffers_reason and buffers:
            manifest.notes.append(f"{len(buffers)} buffer(s) not compared: {skip_buffers_reason}")
        else:
            entries.extend(_tensor_entry(n, "buffer", b) for n, b in buffers)

    if "optimizer" in include and optimizers:
        names = {id(p): n for n, p in reversed(named_params)}
        multi = len(optimizers) > 1
        for oi, opt in enumerate(optimizers):
            prefix = f"optimizers.{oi}." if multi else ""
            for gi, group in enumerate(opt.param_groups):
                for pi, p in enumerate(group["params"]):
                    pname = names.get(id(p)) or f"{prefix}param_groups.{gi}.params.{pi}"
                    state = opt.state.get(p)
                    if not state:
                        continue
                    for key in sorted(state, key=str):
                        n = f"{pname}.{key}"
                        if not _glob_excluded(n, exclude):
                            _value_entries(entries, n, "optimizer", state[key], state, key)
            for gi, group in enumerate(opt.param_groups):
                for key in sorted(group, key=str):
                    if key == "params":
                        continue
                    n = f"{prefix}param_groups.{gi}.{key}"
                    if not _glob_excluded(n, exclude):
                        _value_entries(entries, n, "optimizer", group[key], group, key)

    if "grads" in include:
        for n, p in named_params:
            if _glob_excluded(n, exclude):
                continue
            if p.grad is None:
                entries.append(Entry(n, "grad", torch.empty(0, dtype=torch.uint8), "none", ()))
            else:
                entries.append(_tensor_entry(n, "grad", p.grad))

    manifest.notes.extend(sorted({e.note for e in entries if e.note}))
    return manifest


def has_shards(entries: Sequence[Entry]) -> bool:
    """Whether any entry is a DTensor (equal on every rank when the structures agree)."""
    return any(map(attrgetter("shard"), entries))


# -- optimizers inside engine wrappers ------------------------------------------------------

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
    if hasattr(opt, "_optimizer_step_pre_hooks"):
        return opt
    torch_ones = list(itertools.takewhile(lambda o: isinstance(o, torch.optim.Optimizer), _chain(opt)[1:]))
    return torch_ones[-1] if torch_ones else opt


def before_update(args: tuple[Any, ...], kwargs: dict[str, Any], then: Callable[[bool], None]) -> Any:
    """From an optimizer pre-step hook (``args``: the optimizer, then any closure): ``then`` once, before the update:
    now (``then(False)``; returns None), or once a closure's first call ran the backward (``then(True)``; new args)."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        then(False)
        return None
    done: list[bool] = []

    def then_after() -> Any:
        loss = closure()
        if not done:
            done.append(True)
            then(True)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": then_after}
    return (args[0], then_after, *args[2:]), kwargs


def _chain(opt: Any) -> list[Any]:
    """``opt`` and the optimizers it wraps (``.optimizer``, link after link; at most 6, never a cycle)."""
    chain = [opt]
    while len(chain) < 6:
        inner = getattr(chain[-1], "optimizer", None)
        if inner is None or any(inner is c for c in chain):
            break
        chain.append(inner)
    return chain
