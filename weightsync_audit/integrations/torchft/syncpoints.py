"""LocalSGD and DiLoCo: what is equal on every replica at a synchronisation, and only then.

Between synchronisations the replicas train apart by design, so they are audited at the sync points only,
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

>>> import torch
>>> tree = mirror({"layers.0.weight": torch.zeros(2), "bias": torch.ones(1)})
>>> sorted(name for name, _ in tree.named_buffers())
['bias', 'layers.0.weight']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from weightsync_audit.integrations.torchft.compat import diloco_fragments, is_diloco, is_local_sgd, local_sgd_model

__all__ = ["SyncTargets", "mirror", "sync_targets"]


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
