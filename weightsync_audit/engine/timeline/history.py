"""What an :class:`~weightsync_audit.Auditor` remembers across audits (and checkpoints)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from weightsync_audit.reporting.record import AuditResult

__all__ = ["AuditHistory"]


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
    last_diverged_tensors: list[str] = field(default_factory=list)
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
            self.last_diverged_tensors = []
        else:
            self.diverged_audits += 1
            # Parameters first: the summary names a diverged parameter before optimizer entries.
            names = [m.name for m in sorted(result.mismatches, key=lambda m: m.kind != "param")]
            if self.first_divergence_step is None and not self.first_divergence_tensors:
                self.first_divergence_step = result.step
                self.first_divergence_tensors = names
            self.last_diverged_tensors = names
            if result.pinpoint in ("exact", "sampled"):
                if self.first_diverged_step is None:
                    self.first_diverged_step = result.first_diverged_step
                if result.pinpoint == "exact" and result.last_in_sync_step is not None:
                    # Known in sync at that step, though no audit ran there.
                    known = result.last_in_sync_step
                    prior = self.last_in_sync_step
                    self.last_in_sync_step = known if prior is None else max(prior, known)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)  # the lists copied

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Tolerant of older or partial checkpoints: missing keys keep their defaults.
        for key in self.state_dict():
            if key in state:
                value = state[key]
                setattr(self, key, list(value) if isinstance(value, (list, tuple)) else value)
