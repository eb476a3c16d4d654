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

What the auditor remembers across audits (and checkpoints), the history each context carries, is
:class:`AuditHistory`.

What each phase of an audit hands the next: small frozen results (:mod:`~weightsync_audit.engine.run`).

Every field is set once, by the phase that returns it, and read by those after it: what a phase needs is
its parameters, what it leaves its return value. The mismatches themselves are the record's rows
(:class:`~weightsync_audit.reporting.record.Mismatch`), filled in as they are measured.

======================  =================================  ==============================================
phase                   returns                            read by
======================  =================================  ==============================================
prepare                 :class:`Prepared`                  every later phase
agree                   :class:`~weightsync_audit.engine.agreement.rounds.Agreement`  localize, explain
localize                :class:`Localized`                 measure, explain
measure                 :class:`Measured`                  explain
explain                 :class:`Explained`                 record
record                  :class:`~weightsync_audit.reporting.record.AuditResult`
======================  =================================  ==============================================
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.agreement.consensus import StructureDiff, ValueDiff
from weightsync_audit.engine.attribution.watch import StepWatch
from weightsync_audit.engine.config import AuditConfig, AuditRequest
from weightsync_audit.engine.hashing.manifest_cache import PreparedManifest
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.engine.timeline.pinpoint import Pinpoint, Pinpointer
from weightsync_audit.engine.timeline.step_records import BatchRecords, StepHyper
from weightsync_audit.reporting.record import AuditResult, Mismatch

__all__ = [
    "AuditContext",
    "AuditHistory",
    "Explained",
    "Localized",
    "Measured",
    "Prepared",
    "SharedHints",
    "Tally",
]


@dataclass(slots=True)
class AuditHistory:
    """What the auditor remembers across audits (and checkpoints)."""

    audits: int = 0
    diverged_audits: int = 0
    resyncs: int = 0
    last_in_sync_step: int | None = None
    last_full_sync_step: int | None = None
    """The last step at which an audit read every byte (no sampling) and found the ranks in sync."""
    first_divergence_step: int | None = None
    first_divergence_tensors: list[str] = field(default_factory=list)
    first_diverged_step: int | None = None
    """The first step pinpointed as diverged (``pinpoint=True`` only)."""
    compared_nothing: int = 0
    """Audits that compared no tensor between ranks (none to audit, or none with a replica)."""

    def record(self, result: AuditResult) -> None:
        self.audits += 1
        self.compared_nothing += bool(result.nothing_compared)
        if result.in_sync:
            self.last_in_sync_step = result.step
            if not result.coverage:
                self.last_full_sync_step = result.step
        else:
            self.diverged(result)
            if result.pinpoint in ("exact", "sampled"):
                if self.first_diverged_step is None:
                    self.first_diverged_step = result.first_diverged_step
                if result.pinpoint == "exact" and result.last_in_sync_step is not None:
                    # Known in sync at that step, though no audit ran there.
                    known = result.last_in_sync_step
                    prior = self.last_in_sync_step
                    self.last_in_sync_step = known if prior is None else max(prior, known)

    def diverged(self, result: AuditResult) -> None:
        """A divergence ``result`` found (any audit of the run's, the gradients' before a step too): counted, and
        the run's first when none came before, its names parameters first (a summary names one before optimizer
        entries)."""
        self.diverged_audits += 1
        if self.first_divergence_step is None and not self.first_divergence_tensors:
            names = [m.name for m in sorted(result.mismatches, key=lambda m: m.kind != "param")]
            self.first_divergence_step, self.first_divergence_tensors = result.step, names

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)  # the lists copied

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Tolerant of older or partial checkpoints: missing keys keep their defaults.
        for key in self.state_dict():
            if key in state:
                value = state[key]
                setattr(self, key, list(value) if isinstance(value, (list, tuple)) else value)


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
    request: AuditRequest = field(kw_only=True)
    """What the audit covers beside the settings: whether it consumes the :attr:`watch`'s records (``counted``,
    the run's own) or only blames from them, and reads the step under way's too (``before_step``)."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """This rank's manifest (cached while the structure holds), its digests, and the summary it sends."""

    manifest: PreparedManifest
    digests: np.ndarray
    buckets: np.ndarray
    """Which sketch bucket each digest falls in (where a divergence lies, to the bucket)."""
    summary: np.ndarray
    """The fixed-size row the coordinator compares (:data:`~weightsync_audit.engine.agreement.consensus.SUMMARY_FIELDS`, then the sketch)."""
    failure: BaseException | None
    """Why this rank could not prepare its audit (raised on every rank together, after agree), else ``None``."""


@dataclass(frozen=True, slots=True)
class Localized:
    """Off the healthy path: which tensors differ, on which ranks (empty lists on the healthy path)."""

    entries: list[Entry]
    """This rank's entries, read only when needed (a divergence, or DTensors to compare within peer sets)."""
    value_diffs: list[ValueDiff]
    structure_diffs: list[StructureDiff]
    structural: list[Mismatch]
    """One mismatch per structure difference (a pipeline stage's own value differing among its holders too)."""
    union: dict[str, int] | None
    """With differing structures, what was compared, counted over every rank (the same everywhere)."""
    peers: Any
    """The DTensor peer sets the comparison used, else ``None``."""


@dataclass(frozen=True, slots=True)
class Tally:
    """What was compared (by kind) and the notes so far: taken once per audit."""

    checked: dict[str, int]
    notes: list[str]


@dataclass(frozen=True, slots=True)
class SharedHints:
    """The first rank's hints, notes and where the odd ranks run: the same on every rank."""

    hints: list[str]
    notes: list[str]
    hosts: dict[str, str] | None

    def pack(self) -> bytes:
        """The bytes the first rank sends (compressed when that pays: the hints' words repeat)."""
        raw = json.dumps([self.hints, self.notes, self.hosts or {}]).encode()
        packed = b"z" + zlib.compress(raw, 6)
        return packed if len(packed) < len(raw) else raw

    @classmethod
    def unpack(cls, payload: bytes) -> SharedHints:
        """What :meth:`pack` sent, on every rank."""
        hints, notes, hosts = json.loads(zlib.decompress(payload[1:]) if payload[:1] == b"z" else payload)
        return cls(hints, notes, hosts or None)


@dataclass(frozen=True, slots=True)
class Measured:
    """The mismatches with their gaps, ranks made global and the tolerance applied; what measuring took early."""

    mismatches: list[Mismatch]
    tally: Tally | None
    """Taken here when values differ: the hints ride the gaps' last round, so what they say is known before it."""
    shared: SharedHints | None
    """The hints that rode the gaps' last round, else ``None`` (explain asks for them in a round of their own)."""


@dataclass(frozen=True, slots=True)
class Explained:
    """Everything the record says beyond the mismatches: counts, notes, hints, hosts, pinpoint and blame."""

    mismatches: list[Mismatch]
    checked: dict[str, int]
    notes: list[str]
    hints: list[str]
    hosts: dict[str, str] | None
    pin: Pinpoint | None
    transient: dict[str, Any] | None
    blame: dict[str, Any] | None
