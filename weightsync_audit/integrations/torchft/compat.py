"""Every torchft internal the integration reads, in one place, and what a LocalSGD/DiLoCo sync audits.

torchft 0.2 gives its quorum to the ``Manager`` only: the quorum's id, this replica's rank in it, the
address of the store every member reaches, who heals and from whom live in a ``QuorumResult`` that the
Manager reads from its ``ManagerClient`` and keeps no copy of. :class:`QuorumTap` stands between the
Manager and its client and keeps the last result it handed over (nothing else changes: every call goes
through unchanged). The Manager's group rank is a private field;
LocalSGD's model and DiLoCo's fragments too. :func:`check_manager` verifies, once, that what the
integration relies on is there, and names the torchft version when it is not.

torchft is never imported here: objects are recognised by class name and read by attribute.

**LocalSGD and DiLoCo**: what is equal on every replica at a synchronisation, and only then. Between synchronisations the replicas train apart by design, so they are audited at the sync points only,
right after a sync committed, and never in between (no audit runs there, so none can raise a false alarm):

- **LocalSGD** averages the model's parameters: at a sync point every replica holds the same parameters.
  Its local optimizer's state and the buffers stay per replica by design and are not compared.
- **DiLoCo** (and Streaming DiLoCo) syncs one fragment at a time: the fragment's pseudo-gradients are
  averaged and its outer optimizer steps from them. Every fragment's global copy (``original_parameters``)
  and the outer optimizers' state are equal on every replica at any sync point; the fragment just synced
  also holds its global parameters live (unless ``fragment_update_alpha`` > 0 mixes local ones back in, by
  design). The other fragments' live parameters and the inner optimizer's state are per replica.

:func:`sync_targets` reads the LocalSGD or DiLoCo object once and returns what each sync audits: one module
(the user's own for LocalSGD; for DiLoCo a container that references, never copies, each fragment's module
as ``fragment<i>`` and its global copy as ``global<i>``), the optimizers, and per fragment what to leave out.

>>> Quorum.of(None) is None
True
>>> tree = mirror({"layers.0.weight": torch.zeros(2), "bias": torch.ones(1)})
>>> sorted(name for name, _ in tree.named_buffers())
['bias', 'layers.0.weight']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Mapping

import torch
from torch import nn

from weightsync_audit.compat import class_names

__all__ = [
    "DiLoCoFragment",
    "Heals",
    "Quorum",
    "QuorumTap",
    "SyncTargets",
    "TorchFTCompatError",
    "check_manager",
    "diloco_fragments",
    "group_rank",
    "is_diloco",
    "is_local_sgd",
    "local_sgd_model",
    "mirror",
    "sync_targets",
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


def mirror(tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """A module tree whose buffers *are* ``tensors`` (dotted names become submodules; nothing is copied)."""
    nodes: dict[str, nn.Module] = {"": nn.Module()}
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        where = ""
        for part in path:
            parent, where = nodes[where], f"{where}.{part}" if where else part
            if where not in nodes:
                nodes[where] = nn.Module()
                parent.add_module(part, nodes[where])
        nodes[where].register_buffer(leaf, t)
    return nodes[""]


@dataclass
class SyncTargets:
    """What a sync point audits."""

    algorithm: str
    """``LocalSGD`` or ``DiLoCo``."""
    module: nn.Module
    optimizers: list[Any]
    include: tuple[str, ...]
    sync_every: int
    owners: list[tuple[Any, int | None]] = field(default_factory=list)
    """The objects whose sync method marks a sync point, with their fragment (LocalSGD itself, ``None``;
    each DiLoCo fragment, its index)."""
    method: str = "sync"
    """That method's name (``sync``; ``perform_sync`` for a DiLoCo fragment, which returns whether it committed)."""
    per_fragment_exclude: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """DiLoCo: at fragment i's sync, the live parameters that are per replica by design (exact names)."""
    mixes_local: frozenset[int] = frozenset()
    """DiLoCo: the fragments whose live parameters mix local ones back in after a sync (``fragment_update_alpha``)."""

    def note(self, fragment: int | None) -> str:
        """What the record says about this sync point."""
        if self.algorithm == "LocalSGD":
            return (
                f"audited at a LocalSGD sync point (every {self.sync_every} local steps): the averaged parameters "
                "are compared; between syncs the replicas differ by design and no audit runs; the local "
                "optimizer's state and the buffers are per replica by design, not compared"
            )
        live = "its live parameters, " if fragment not in self.mixes_local else ""
        return (
            f"audited at a DiLoCo sync point (fragment {fragment}, every {self.sync_every} inner steps per "
            f"fragment): {live}every fragment's global parameters and the outer optimizer state are compared; "
            "between syncs the replicas differ by design and no audit runs; the inner optimizer's state and the "
            "other fragments' live parameters are per replica by design, not compared"
        )


def sync_targets(sync: Any) -> SyncTargets:
    """What the sync points of ``sync`` (a ``torchft.local_sgd.LocalSGD`` or ``DiLoCo``) audit."""
    if is_local_sgd(sync):
        return SyncTargets(
            "LocalSGD",
            local_sgd_model(sync),
            [],
            ("params",),
            int(getattr(sync, "_sync_every", 0)),
            owners=[(sync, None)],
        )
    if not is_diloco(sync):
        raise TypeError(f"sync must be a torchft.local_sgd.LocalSGD or DiLoCo, got {type(sync).__name__}")
    fragments = diloco_fragments(sync)
    root = nn.Module()
    optimizers: list[Any] = []
    live: dict[int, list[str]] = {}
    for frag in fragments:
        root.add_module(f"fragment{frag.index}", frag.module)
        root.add_module(f"global{frag.index}", mirror(frag.global_copy))
        if not any(frag.outer_optimizer is o for o in optimizers):
            optimizers.append(frag.outer_optimizer)
        live[frag.index] = [f"fragment{frag.index}.{n}" for n, _ in frag.module.named_parameters()]
    exclude = {
        f.index: tuple(n for g in fragments if g.index != f.index or f.mixes_local for n in live[g.index])
        for f in fragments
    }
    every = int(getattr(sync, "_sync_every", 0))
    return SyncTargets(
        "DiLoCo",
        root,
        optimizers,
        ("params", "buffers", "optimizer"),
        every,
        owners=[(f.owner, f.index) for f in fragments],
        method="perform_sync",
        per_fragment_exclude=exclude,
        mixes_local=frozenset(f.index for f in fragments if f.mixes_local),
    )
