"""Every torchft internal the integration reads, in one place (beside the core's compat modules).

torchft 0.2 gives its quorum to the ``Manager`` only: the quorum's id, this replica's rank in it, the
address of the store every member reaches, who heals and from whom live in a ``QuorumResult`` that the
Manager reads from its ``ManagerClient`` and keeps no copy of. :class:`QuorumTap` stands between the
Manager and its client and keeps the last result it handed over (nothing else changes: every call goes
through unchanged). The Manager's group rank, its group's size and its quorum mode are private fields;
LocalSGD's model and DiLoCo's fragments too. :func:`check_manager` verifies, once, that what the
integration relies on is there, and names the torchft version when it is not.

torchft is never imported here: objects are recognised by class name and read by attribute.

>>> Quorum.of(None) is None
True
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable

from torch import nn

from weightsync_audit.compat_engines import class_names

__all__ = [
    "DiLoCoFragment",
    "Heals",
    "Quorum",
    "QuorumTap",
    "TorchFTCompatError",
    "check_manager",
    "diloco_fragments",
    "group_rank",
    "group_world_size",
    "is_diloco",
    "is_local_sgd",
    "local_sgd_model",
    "uses_async_quorum",
    "wrap_method",
]


class TorchFTCompatError(RuntimeError):
    """A torchft internal the integration relies on is missing (another torchft version)."""


def _version() -> str:
    try:
        return metadata.version("torchft")
    except metadata.PackageNotFoundError:
        return "unknown"


def _require(obj: Any, attr: str, what: str) -> Any:
    if not hasattr(obj, attr):
        raise TorchFTCompatError(
            f"weightsync audit: torchft {_version()} has no {type(obj).__name__}.{attr} ({what}); the torchft "
            "integration is written against torchft 0.2: please report this with the versions"
        )
    return getattr(obj, attr)


def check_manager(manager: Any) -> None:
    """Raise :class:`TorchFTCompatError`, naming the torchft version, when a Manager internal is gone."""
    if "Manager" not in class_names(manager):
        raise TypeError(f"manager must be a torchft.manager.Manager, got {type(manager).__name__}")
    client = _require(manager, "_client", "the Manager's client of its ManagerServer, which hands it the quorum")
    _require(client, "_quorum", "the ManagerClient's quorum call")
    for attr, what in (
        ("_group_rank", "this process's rank in its replica group"),
        ("_group_world_size", "the replica group's size"),
        ("_use_async_quorum", "whether the quorum runs beside the forward pass"),
        ("current_step", "the Manager's committed step"),
        ("batches_committed", "the Manager's count of committed batches"),
    ):
        _require(manager, attr, what)


@dataclass(frozen=True, slots=True)
class Quorum:
    """What one quorum told this replica group (torchft's ``QuorumResult``, copied)."""

    quorum_id: int
    replica_rank: int
    """This replica group's rank among the quorum's replica groups (the managed process group's rank)."""
    replica_world_size: int
    store_address: str
    """``host:port`` of the store every member of the quorum reaches (the one torchft's process group meets in)."""
    heal: bool
    """This replica group heals from a peer at this step."""
    recover_src: int | None
    """The replica rank this one heals from, when it heals."""
    max_step: int
    max_world_size: int
    """How many replica groups are at ``max_step``; fewer than ``replica_world_size`` means some heal."""
    replica_ids: tuple[str, ...]

    @classmethod
    def of(cls, result: Any) -> Quorum | None:
        if result is None:
            return None
        return cls(
            quorum_id=int(result.quorum_id),
            replica_rank=int(result.replica_rank),
            replica_world_size=int(result.replica_world_size),
            store_address=str(result.store_address),
            heal=bool(result.heal),
            recover_src=None if result.recover_src_replica_rank is None else int(result.recover_src_replica_rank),
            max_step=int(result.max_step),
            max_world_size=int(result.max_world_size),
            replica_ids=tuple(str(i) for i in result.replica_ids),
        )

    @property
    def someone_heals(self) -> bool:
        """Some member of this quorum heals at this step (every member reads the same)."""
        return self.replica_world_size > self.max_world_size

    def replica_id(self, replica_rank: int) -> str:
        ids = self.replica_ids
        return ids[replica_rank] if 0 <= replica_rank < len(ids) else str(replica_rank)


@dataclass(frozen=True, slots=True)
class Heals:
    """The heals seen in the quorums since the last audit point (every member of a quorum sees the same)."""

    someone: bool = False
    """Some member of a quorum healed (at a step that may not have committed: then the next committed one
    is the first after the heal, for every member)."""
    source: int | None = None
    """This replica group healed, from this replica rank (the latest heal)."""

    @property
    def this_replica(self) -> bool:
        return self.source is not None


class QuorumTap:
    """Stands for the Manager's ``ManagerClient``: keeps the last quorum it returned (:attr:`latest`) and the
    heals seen since they were last taken (:meth:`take_heals`)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.latest: Quorum | None = None
        self.heals = Heals()

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self.client._quorum(*args, **kwargs)
        quorum = Quorum.of(result)
        if quorum is not None and (quorum.someone_heals or quorum.heal):
            # ``someone`` only from what every member reads alike (an initial sync at step 0 heals replicas
            # at the same step: the first quorum is audited anyway); ``source`` from this replica's own heal.
            source = quorum.recover_src if quorum.heal else self.heals.source
            self.heals = Heals(self.heals.someone or quorum.someone_heals, source)
        self.latest = quorum
        return result

    def take_heals(self) -> Heals:
        """The heals seen since the last call (and forget them: an audit point covers them)."""
        heals, self.heals = self.heals, Heals()
        return heals

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    @classmethod
    def install(cls, manager: Any) -> QuorumTap:
        """The Manager's tap, installed between it and its client (once: a second audit shares it)."""
        current = manager._client
        if isinstance(current, QuorumTap):
            return current
        tap = cls(current)
        manager._client = tap
        return tap


def group_rank(manager: Any) -> int:
    return int(manager._group_rank)


def group_world_size(manager: Any) -> int:
    return int(manager._group_world_size)


def uses_async_quorum(manager: Any) -> bool:
    return bool(manager._use_async_quorum)


def is_local_sgd(obj: Any) -> bool:
    return "LocalSGD" in class_names(obj)


def is_diloco(obj: Any) -> bool:
    return "DiLoCo" in class_names(obj)


def local_sgd_model(local_sgd: Any) -> nn.Module:
    """The model whose parameters LocalSGD averages at each sync."""
    return _require(local_sgd, "_model", "LocalSGD's model")


@dataclass(frozen=True, slots=True)
class DiLoCoFragment:
    """One fragment of a (Streaming) DiLoCo run, as the audit reads it."""

    index: int
    owner: Any
    """torchft's fragment object (its ``perform_sync`` marks a sync point)."""
    module: nn.Module
    global_copy: dict[str, Any]
    """The fragment's global parameters (``original_parameters``): equal on every replica after its sync."""
    outer_optimizer: Any
    mixes_local: bool
    """``fragment_update_alpha > 0``: the live parameters mix in local ones after a sync, by design."""


def diloco_fragments(diloco: Any) -> list[DiLoCoFragment]:
    """DiLoCo's fragments, in order."""
    out = []
    for i, frag in enumerate(_require(diloco, "_fragments", "DiLoCo's model fragments")):
        out.append(
            DiLoCoFragment(
                index=int(getattr(frag, "_fragment_id", i)),
                owner=frag,
                module=_require(frag, "_model_fragment", "a DiLoCo fragment's module"),
                global_copy=_require(frag, "original_parameters", "a DiLoCo fragment's global parameters"),
                outer_optimizer=_require(frag, "_outer_optimizer", "a DiLoCo fragment's outer optimizer"),
                mixes_local=float(getattr(frag, "_fragment_update_alpha", 0.0)) > 0.0,
            )
        )
    return out


def wrap_method(obj: Any, name: str, after: Callable[[Any], None]) -> Callable[[], None]:
    """Make ``obj.name(...)`` call ``after(its result)`` once it returns; returns what undoes it."""
    original = _require(obj, name, f"the method the audit follows ({name})")

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        after(result)
        return result

    setattr(obj, name, wrapped)

    def undo() -> None:
        if getattr(obj, name, None) is wrapped:
            try:
                delattr(obj, name)  # the class's method shows through again
            except AttributeError:
                setattr(obj, name, original)

    return undo
