"""What each phase of an audit hands the next: small frozen results (:mod:`~weightsync_audit.engine.run`).

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
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightsync_audit.engine.agreement.consensus import StructureDiff, ValueDiff
from weightsync_audit.engine.hashing.manifest_cache import PreparedManifest
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.engine.timeline.pinpoint import Pinpoint
from weightsync_audit.reporting.record import Mismatch

__all__ = ["Explained", "Localized", "Measured", "Prepared", "SharedHints", "Tally"]


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
