"""Every private torch and Lightning internal the library touches, in one version-aware place.

Each accessor says what it relies on; :func:`self_check` verifies that what this torch provides is
still there and fails loudly, naming the versions, when an internal has gone. Accessors whose absence
only costs a hint (DDP's reducer buckets, its logging data) return ``None`` instead of raising.

>>> self_check()  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "CompatError",
    "class_names",
    "ddp_comm_hooks",
    "ddp_reducer_parameter_ids",
    "ddp_synced_count",
    "default_process_group",
    "default_store",
    "dtensor_box",
    "dtensor_local",
    "dict_version_reader",
    "is_dtensor",
    "flatten_tensors",
    "is_timeout_text",
    "layout_guard",
    "lightning_ddp_factory",
    "lightning_reset_static_graph",
    "new_named_gloo_group",
    "module_attr",
    "peel_wrapper",
    "remove_ddp_autograd_hooks",
    "self_check",
    "stream_ordered",
    "synchronize",
    "tensor_version",
]


class CompatError(RuntimeError):
    """A private torch/Lightning internal the library relies on is missing in the installed version."""


def _versions() -> str:
    text = f"torch {torch.__version__}"
    for name in ("lightning", "pytorch_lightning"):
        try:
            mod = __import__(name)
            text += f", {name} {getattr(mod, '__version__', '?')}"
        except ImportError:
            pass
    return text


def _require(obj: Any, attr: str, what: str) -> Any:
    value = getattr(obj, attr, None)
    if value is None:
        raise CompatError(
            f"weightsync_audit needs {what} ({attr}), which is missing in {_versions()}; "
            "please report this with the versions named here"
        )
    return value


# -- torch.distributed -------------------------------------------------------------------------


def default_process_group() -> Any:
    """The default process group (``distributed_c10d._get_default_group``)."""
    return _require(dist.distributed_c10d, "_get_default_group", "torch.distributed's default group accessor")()


def default_store() -> Any:
    """The job's key-value store (``distributed_c10d._get_default_store``)."""
    return _require(dist.distributed_c10d, "_get_default_store", "torch.distributed's default store accessor")()


def new_named_gloo_group(ranks: Sequence[int], name: str, timeout: timedelta) -> Any:
    """A gloo process group over ``ranks`` (global, sorted), created by the member ranks only, under ``name``.

    ``dist.new_group(..., use_local_synchronization=True)`` names its group (and so the store prefix where
    the members rendezvous) by hashing the ranks with ``len(_world.pg_names)``: the number of groups this
    process belongs to. Once another library made groups that not every rank belongs to (Megatron-core's
    ``initialize_model_parallel`` with pipeline stages: ranks of the first stage join an embedding group the
    others do not), that count differs per rank, the members of one group compute different names and wait
    for each other in different places until the deadline. The caller passes a name every member computes
    alike; the group is made as ``new_group`` makes it (``_new_process_group_helper``, then the
    global-to-group rank map) and is registered, so ``dist.isend(group=...)`` and ``destroy_process_group``
    work on it.
    """
    c10d = dist.distributed_c10d
    helper = _require(c10d, "_new_process_group_helper", "torch.distributed's process group factory")
    world = _require(c10d, "_world", "torch.distributed's group registry")
    ranks = list(ranks)
    pg, _ = helper(
        len(ranks),
        ranks.index(dist.get_rank()),
        ranks,
        "gloo",
        default_store(),
        group_name=name,
        timeout=timeout,
        group_desc=name,
    )
    world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


def is_timeout_text(text: str) -> bool:
    """Whether a gloo wait error says the deadline passed (vs. a peer closing its connection).

    gloo words a timeout "Timed out waiting ... for recv operation"; after a timeout closes a context's
    pairs, later waits fail with "Application timeout caused pair closure", which is a closed connection.
    """
    return "Timed out" in text or ("timeout" in text.lower() and "closure" not in text)


# -- DistributedDataParallel -------------------------------------------------------------------


def ddp_reducer_parameter_ids(ddp: nn.parallel.DistributedDataParallel) -> set[int] | None:
    """ids of the parameters in the reducer's buckets (``reducer._get_zeros_like_grad_buckets``), or
    ``None`` when this torch lacks it. Allocates gradient-sized buffers: rare paths only."""
    reducer = getattr(ddp, "reducer", None)
    buckets = getattr(reducer, "_get_zeros_like_grad_buckets", None)
    if not callable(buckets):
        return None
    ids: set[int] = set()
    for bucket in buckets():
        ids.update(id(p) for p in bucket.parameters())
    return ids


def ddp_synced_count(ddp: nn.parallel.DistributedDataParallel) -> int | None:
    """How many parameter tensors the reducer covers (``_get_ddp_logging_data``), or ``None``."""
    logging_data = getattr(ddp, "_get_ddp_logging_data", None)
    if not callable(logging_data):
        return None
    try:
        return int(logging_data()["num_parameter_tensors"])
    except (KeyError, TypeError, ValueError, RuntimeError):
        return None


def ddp_comm_hooks(ddp: nn.parallel.DistributedDataParallel) -> list[tuple[Callable[..., Any], object]]:
    """The ``(hook, state)`` pairs registered with ``register_comm_hook``, oldest first (``_comm_hooks``)."""
    return list(getattr(ddp, "_comm_hooks", []) or [])


def remove_ddp_autograd_hooks(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Detach a retired wrapper's reducer from the parameters (``_remove_autograd_hooks``)."""
    _require(ddp, "_remove_autograd_hooks", "DistributedDataParallel's hook removal")()


# -- devices ---------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait until every stream of ``device`` has finished its queued work (nothing to wait for on the CPU).

    Weights may be written on a side stream (overlapped all-gathers, asynchronous copies, side-stream
    optimizers): kernels on the current stream, and copies to the host, only wait for the current
    stream, so a digest could read a tensor mid-update. ``torch.accelerator.synchronize`` when this
    torch has it and ``device`` is the current accelerator, else the device module's own
    ``synchronize`` (``torch.cuda``, ``torch.xpu``, ``torch.mps``...); a device type with neither
    (``meta``) has nothing to wait for.
    """
    if device.type == "cpu":
        return
    if getattr(_ordered, "active", False):  # this thread's stream was ordered after the writes it reads
        module = getattr(torch, device.type, None)
        current_stream = getattr(module, "current_stream", None)
        if callable(current_stream):
            current_stream(device).synchronize()
            return
    accelerator = getattr(torch, "accelerator", None)
    current = getattr(accelerator, "current_accelerator", None)
    if callable(current) and hasattr(accelerator, "synchronize"):
        acc = current()
        if acc is not None and acc.type == device.type:
            accelerator.synchronize(device)  # type: ignore[union-attr]
            return
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    if callable(sync):
        try:
            sync(device)
        except TypeError:  # a module whose synchronize takes no device (mps)
            sync()


_ordered = threading.local()


@contextmanager
def stream_ordered() -> Iterator[None]:
    """In this thread, :func:`synchronize` waits for the thread's current stream only, not the whole device.

    For a side stream that was made to wait, by an event, for the writes it reads (the overlapped audit's:
    :mod:`weightsync_audit.engine.overlap`): the device keeps running the training's next kernels while
    the digest reads, and a device-wide wait would wait for those too.
    """
    before = getattr(_ordered, "active", False)
    _ordered.active = True
    try:
        yield
    finally:
        _ordered.active = before


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter (``Tensor._version``, private): every in-place write through the tensor
    or a view of it bumps it (not a write through ``.data``, which has a counter of its own)."""
    return int(t._version)


# -- wrappers and tensor types -----------------------------------------------------------------


_MODULE_GETATTR = nn.Module.__getattr__
_OBJECT_GETATTRIBUTE = object.__getattribute__


def module_attr(module: Any, name: str) -> Any:
    """``getattr(module, name, None)``, without ``nn.Module.__getattr__`` raising and catching an
    ``AttributeError`` when ``name`` is absent (the common case, looked up at every audit)."""
    cls = type(module)
    if (
        isinstance(module, nn.Module)
        and cls.__getattr__ is _MODULE_GETATTR
        and cls.__getattribute__ is _OBJECT_GETATTRIBUTE
        and name not in module.__dict__
        and not hasattr(cls, name)
    ):  # not on the instance nor its class: nn.Module's own lookup reads its three dicts, nothing else
        d = module.__dict__
        for key in ("_parameters", "_buffers", "_modules"):
            held = d.get(key)
            if held is not None and name in held:
                return held[name]
        return None
    return getattr(module, name, None)


@functools.lru_cache(maxsize=256)
def class_names(obj: Any) -> set[str]:
    """The names of ``obj``'s class and its bases (recognises a class without importing its package)."""
    return {c.__name__ for c in type(obj).__mro__}


def peel_wrapper(module: nn.Module) -> nn.Module | None:
    """The module inside one layer of wrapping (DDP, DataParallel, Fabric, ``torch.compile``, old
    Lightning), or ``None`` when ``module`` is not a wrapper. Fabric and Lightning are recognised by
    their private class names so that neither is imported here."""
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return module.module
    name = type(module).__name__
    if name == "_FabricModule" and hasattr(module, "_original_module"):
        return module._original_module or module._forward_module
    orig = module_attr(module, "_orig_mod")  # torch.compile's OptimizedModule
    if isinstance(orig, nn.Module):
        return orig
    if name == "_LightningModuleWrapperBase" and hasattr(module, "_forward_module"):
        return module._forward_module  # Lightning < 2.2
    if "DeepSpeedEngine" in class_names(module) and isinstance(module.module, nn.Module):
        return module.module  # deepspeed.DeepSpeedEngine (also Lightning's and Accelerate's)
    if type(module).__module__.startswith("megatron.") and class_names(module) & {
        "_BaseDataParallel",
        "Float16Module",
    }:
        inner = getattr(module, "module", None)
        return inner if isinstance(inner, nn.Module) else None  # Megatron-core's DDP and its fp16/bf16 wrapper
    return None


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (by class name first: a failed ``hasattr`` on a plain tensor is slow)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def dtensor_local(t: Any) -> torch.Tensor:
    """The local tensor a DTensor holds now (``_local_tensor``, which FSDP2 re-assigns in place and of which
    ``to_local()`` gives a view), without ``to_local()``'s autograd call; ``to_local()`` where it is missing."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


def dtensor_box(t: Any) -> tuple[list[int], list[int]] | None:
    """``(global_offset, global_shape)`` of a DTensor's local shard, a box of the global tensor; ``None``
    where the shard is not one box (a placement other than ``Shard``/``Replicate``: ``_StridedShard``,
    ``Partial``) or this torch lacks ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``."""
    if any(type(p).__name__ not in ("Shard", "Replicate") for p in t.placements):
        return None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return None
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if list(shape) != list(t.to_local().shape):
        return None  # not the box the local tensor holds: never compare against a guess
    return [int(o) for o in offset], [int(n) for n in t.shape]


def flatten_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors of one dtype, flattened and concatenated in one C++ call (``torch._utils._flatten_dense_tensors``).

    Falls back to a Python loop of ``reshape`` and one ``cat`` where this torch lacks it.
    """
    from torch import _utils

    flatten = getattr(_utils, "_flatten_dense_tensors", None)
    if flatten is not None:
        return flatten(list(tensors))
    return torch.cat([t.contiguous().reshape(-1) for t in tensors])


def layout_guard(tensors: Sequence[torch.Tensor]) -> Callable[[Sequence[torch.Tensor]], bool] | None:
    """A check, in one C++ loop, that ``tensors`` keep their dtype, device, shape, strides and autograd keys.

    Relies on ``torch._C._dynamo.guards.TensorGuards`` (what ``torch.compile`` guards tensors with);
    ``None`` when this torch lacks it or it does not accept these tensors: callers then compare the same
    properties in Python.
    """
    try:
        from torch._C._dynamo.guards import TensorGuards

        guard = TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
        if not guard.check(*tensors):
            return None
    except Exception:  # noqa: BLE001 - an optional accelerator of a check that also runs without it
        return None

    def check(current: Sequence[torch.Tensor]) -> bool:
        return bool(guard.check(*current))

    return check


def dict_version_reader() -> Callable[[dict[Any, Any]], int] | None:
    """A reader of a dict's version tag (CPython's ``ma_version_tag``, PEP 509), or ``None``.

    The tag changes whenever the dict's contents change and differs between any two dicts, so an
    unchanged tag proves the same dict with the same keys and the same value objects. Relies on
    ``torch._C._dynamo.guards.dict_version`` (what ``torch.compile`` guards dicts with), which only
    CPython before 3.12 serves; ``None`` when it is missing or does not behave so here: callers then
    compare the dicts' keys and values themselves.
    """
    try:
        from collections import defaultdict

        from torch._C._dynamo.guards import dict_version

        probe: defaultdict[str, int] = defaultdict(int)
        before = dict_version(probe)
        probe["x"] += 1
        after = dict_version(probe)
        probe["x"] += 1
        if len({before, after, dict_version(probe), dict_version({})}) != 4:
            return None
    except Exception:  # noqa: BLE001 - an optional accelerator of a check that also runs without it
        return None
    return dict_version  # type: ignore[no-any-return]


# -- Lightning strategies ----------------------------------------------------------------------


def lightning_ddp_factory(strategy: Any) -> Callable[[nn.Module], Any] | None:
    """The DDP strategy's own wrapper factory (``strategy._setup_model``), or ``None``."""
    build = getattr(strategy, "_setup_model", None)
    return build if callable(build) else None


def lightning_reset_static_graph(strategy: Any) -> None:
    """Re-arm Lightning's one-time static-graph flush for a new wrapper (``_pl_static_graph_delay_done``)."""
    if hasattr(strategy, "_pl_static_graph_delay_done"):
        strategy._pl_static_graph_delay_done = False


_checked = False


def self_check() -> None:
    """Raise :class:`CompatError`, naming the versions, when an internal the audit channel needs is gone.

    Run once per process by the first audit (and again whenever it raised).
    """
    global _checked
    if _checked:
        return
    _require(dist.distributed_c10d, "_get_default_group", "torch.distributed's default group accessor")
    _require(dist.distributed_c10d, "_get_default_store", "torch.distributed's default store accessor")
    _require(dist.distributed_c10d, "_new_process_group_helper", "torch.distributed's process group factory")
    _require(dist.distributed_c10d, "_world", "torch.distributed's group registry")
    _require(nn.parallel.DistributedDataParallel, "_remove_autograd_hooks", "DistributedDataParallel's hook removal")
    _checked = True


def describe_this_rank() -> str:
    """Where this process runs, in one line: host, local rank, and the CUDA device (its UUID and PCI bus id)
    when this process already uses CUDA, else ``cpu pid=<pid>``. Never initialises CUDA."""
    import os
    import socket

    where = [socket.gethostname()]
    if "LOCAL_RANK" in os.environ:
        where.append(f"local_rank={os.environ['LOCAL_RANK']}")
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            index = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            where.append(f"cuda:{index}")
            uuid = getattr(props, "uuid", None)
            if uuid is not None:
                where.append(f"GPU-{uuid}")
            bus = getattr(props, "pci_bus_id", None)
            if bus is not None:
                domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
                where.append(f"pci={domain:04x}:{bus:02x}:{device:02x}.0")
            return " ".join(where)
    except Exception:  # noqa: BLE001 - a description is never worth failing the audit for
        pass
    where.append(f"cpu pid={os.getpid()}")
    return " ".join(where)
