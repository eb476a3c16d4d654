"""Everything one audit reads, in one frozen value: :class:`AuditContext`.

A synchronous audit and an overlapped one are the same run over the same inputs, scheduled two ways
(:class:`~weightsync_audit.engine.run.AuditRun` on the calling thread, its subclass
:class:`~weightsync_audit.engine.overlap.OverlapRun` on the overlap's worker). Both take one
context, built by one function (:meth:`Auditor.context <weightsync_audit.engine.auditor.Auditor.context>`)
on the training thread: the settings, the history, the pinpoint ring, the attribution watch, the manifest
prepared for this audit (or why it could not be), the channel, and this rank's per-step evidence for the
step it covers (the batch digest). Nothing a run reads comes from anywhere else, so every phase sees every
option by construction: there is no stand-in that copies some of the auditor's attributes and silently
drops the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.attribution.watch import StepWatch
from weightsync_audit.engine.config import AuditConfig
from weightsync_audit.engine.duplicate_batches import BatchRecords
from weightsync_audit.engine.hashing.manifest_cache import PreparedManifest
from weightsync_audit.engine.timeline.history import AuditHistory
from weightsync_audit.engine.timeline.pinpoint import Pinpointer
from weightsync_audit.engine.timeline.step_hyper import StepHyper

__all__ = ["AuditContext"]


@dataclass(frozen=True, slots=True, eq=False)
class AuditContext:
    """One audit's inputs, set once (:meth:`Auditor.context <weightsync_audit.engine.auditor.Auditor.context>`)."""

    config: AuditConfig
    """The settings of this audit (a ``full`` audit's with ``slices=1``)."""
    comm: Comm
    history: AuditHistory
    pinpointer: Pinpointer | None
    watch: StepWatch | None
    """Attribution's per-step records, exchanged on a divergence to name the corrupted rank (None: the vote)."""
    module: nn.Module | None
    optimizers: list[torch.optim.Optimizer]
    ddp: Any
    """The DDP wrapper, looked up once per audit and handed to every phase that reads it."""
    prepared: PreparedManifest | None
    """This rank's manifest for the audit (cached while the structure holds); ``None`` when it failed."""
    failure: BaseException | None
    """Why the manifest could not be prepared: every rank raises together after the summaries meet."""
    step: int | None = field(kw_only=True, default=None)
    epoch: int | None = field(kw_only=True, default=None)
    hook: str | None = field(kw_only=True, default=None)
    slice_index: int = field(kw_only=True)
    """The sample slice this audit hashes (part of the gathered summary: ranks that disagree are out of step)."""
    batches: BatchRecords | None = field(kw_only=True, default=None)
    """With ``check_batches``: this rank's batch records (their warnings said once)."""
    batch: str | None = field(kw_only=True, default=None)
    """With ``check_batches``: the digest of this rank's batch at :attr:`step`, taken from the records (None:
    none recorded for that step); exchanged by the run."""
    step_hyper: StepHyper | None = field(kw_only=True, default=None)
    """The hyper-parameters each optimizer step read (set by the callbacks): a divergent audit names one
    that differed at a step it covers and was set back since."""
