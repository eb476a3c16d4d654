"""What a resync reads before anything moves: :class:`ResyncState`, prepared once.

A resync needs the audit channel, the model and optimizers as the audit takes them, and their manifest
under each engine's replica rules (so that a tensor is copied only within its holders). Right after an
audit all of it exists already: the auditor hands over its channel and the manifest that audit built
(:meth:`Auditor.resync_state <weightsync_audit.engine.auditor.Auditor.resync_state>`). The standalone
:func:`~weightsync_audit.engine.repair.resync.resync` prepares the same state itself
(:func:`prepare_resync`), its manifest built by the same function the audit's is
(:func:`~weightsync_audit.engine.inventory.replicas.replica_manifest`).

The audit's manifest may leave out what it was told not to compare (``exclude``, buffers DDP broadcasts, the
kinds not in ``include``); what it reported differing it holds exactly as a resync's own manifest would. So a
resync of those names reads it, and of any other name (one a checkpoint comparison added) builds its own:
a choice made from the record and the plan, the same on every rank, and in both cases the same entries.

>>> import torch
>>> model = torch.nn.Linear(2, 1)
>>> state = prepare_resync(model, torch.optim.SGD(model.parameters(), lr=0.1), Comm())
>>> [e.name for e in state.entries({"bias", "param_groups.0.lr"})]
['bias', 'param_groups.0.lr']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest
from weightsync_audit.engine.inventory.manifest import Entry, as_optimizers
from weightsync_audit.engine.inventory.replicas import replica_manifest, stage_module

__all__ = ["RESYNC_KINDS", "ResyncState", "prepare_resync"]

RESYNC_KINDS = frozenset({"param", "buffer", "optimizer"})
"""What a resync copies by name (gradients are asked for apart, with ``grads``)."""


@dataclass(frozen=True, slots=True)
class ResyncState:
    """The channel, the model and optimizers, and (right after an audit) the manifest that audit built."""

    comm: Comm
    module: nn.Module | None
    optimizers: list[torch.optim.Optimizer]
    audited: PreparedManifest | None = None
    """The manifest of the audit this resync follows, under the replica rules; ``None``: one is built."""
    diverged: frozenset[str] = frozenset()
    """The names (of :data:`RESYNC_KINDS`) that audit found differing: the names its manifest answers for."""

    def entries(self, wanted: set[str] | None) -> list[Entry]:
        """This rank's params, buffers and optimizer state (or those ``wanted``) under the replica rules."""
        if self.audited is not None and wanted is not None and wanted <= self.diverged:
            manifest = self.audited.manifest
        else:
            manifest = replica_manifest(self.module, self.optimizers)
        return [e for e in manifest.entries if e.kind in RESYNC_KINDS and (wanted is None or e.name in wanted)]

    def rebuilt(self) -> ResyncState:
        """The state for what follows a resync that changed the optimizers' structure: manifests built anew."""
        return ResyncState(self.comm, self.module, self.optimizers)


def prepare_resync(module: Any, optimizer: Any, comm: Comm) -> ResyncState:
    """The state a resync prepares for itself over ``comm`` (its manifest built when first read).

    ``module`` may be a pipelining ``PipelineStage`` (its stage module is resynced); ``optimizer`` anything
    the audit takes (one, a wrapped one, a sequence)."""
    optimizers = as_optimizers(optimizer)
    return ResyncState(comm, stage_module(module), optimizers)
