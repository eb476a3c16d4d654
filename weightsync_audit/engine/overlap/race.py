"""An overlapped audit never compares a tensor hashed half-updated: :class:`RaceGuard` and :class:`OverlapRun`.

Between one optimizer step and the next the audited tensors are at rest, so their digest can run while
the next forward and backward run; the optimizer's pre-step hook waits for it before the step writes
them. Anything else that writes them in that window (a manual ``p.mul_()``, a WGAN's ``p.clamp_()``, an
EMA kept in a parameter, a buffer the forward updates and the audit compares) would be read mid-write.

Two guards, so that no such write is ever reported as a divergence:

- :class:`RaceGuard` stamps every audited tensor whose digest the worker computes (its version counter
  and its address) when the audit is launched, right after the step, and looks again once the digests
  are done: a write in between is *seen* and named. The tensors stamped are the ones whose counter a
  write moves: the parameters themselves (a cached manifest holds them; a first manifest holds
  ``detach()`` views, which share the parameter's counter) and the optimizer state and buffers
  themselves. The rank that saw a write flags its summary as failed, :class:`OverlapRun` shares every
  rank's reason in one more round and raises :class:`~weightsync_audit.AuditRaceError` on every rank
  together, and the window audits again at rest, before the next optimizer step.
- A **difference** the overlapped read found is never reported from that read: every rank raises the same
  :class:`~weightsync_audit.AuditRaceError` (the verdict is the coordinator's, the same everywhere) and the
  window decides it at rest, where nothing writes, exactly as a synchronous audit would. A divergence thus
  costs one synchronous audit more; a healthy step costs nothing more.

What no stamp sees, and only the second guard covers: a write through ``.data`` (its alias has a
version counter of its own), through another tensor's raw pointer, by a kernel on another stream that
the training did not order before the launch, or by the hardware. Such a write in the window is not
named; when it made the ranks' reads differ, the audit at rest decides (no false divergence); when every
rank read the same bytes (all before, or all after, the write), the audit stands for what it read.
Small CPU tensors (up to 64 KiB: biases, norms, a BatchNorm's running statistics, optimizer scalars) and
Python values (learning rates) are read at launch, on the training thread, so the next forward updating
running statistics, or a scheduler stepping in the window, changes nothing the audit reads (from the
second audit on, once the manifest is cached; the first one reads everything on the worker, stamped).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from weightsync_audit.compat import tensor_version
from weightsync_audit.engine.agreement.rounds import Agreement
from weightsync_audit.engine.hashing.manifest_cache import PreparedManifest
from weightsync_audit.engine.phases import Prepared
from weightsync_audit.engine.run import AuditRun
from weightsync_audit.errors import AuditPreparationError, AuditRaceError
from weightsync_audit.text import brief_names

__all__ = ["RACE", "OverlapRun", "RaceGuard"]

RACE = AuditRaceError.__name__
"""How a race reads in the shared failure report: ``AuditRaceError: ...``."""


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    try:
        return tensor_version(t), t.data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without storage (meta) has nothing to race on
        return -1, -1


class RaceGuard:
    """The audited tensors' version counters and addresses at launch, to compare once they are digested."""

    def __init__(self, prepared: PreparedManifest) -> None:
        seen: set[int] = set()
        self.tensors: list[torch.Tensor] = []
        later = prepared.sources
        if prepared.in_place is not None and len(prepared.slow_mask) == len(prepared.sources):
            # The small CPU tensors were hashed at launch, at rest: a write to them afterwards (a BatchNorm's
            # running statistics in the next forward) is not this audit's; only what the worker reads counts.
            later = list(itertools.compress(prepared.sources, prepared.slow_mask))
        for t in (*later, *prepared.dynamic):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                self.tensors.append(t)
        self.stamps = list(map(_stamp, self.tensors))

    def moved(self) -> list[torch.Tensor]:
        """The tensors written (or re-pointed) since the stamps were taken."""
        return [t for t, s in zip(self.tensors, self.stamps) if _stamp(t) != s]

    def describe(self, moved: Sequence[torch.Tensor], prepared: PreparedManifest, step: int | None) -> str:
        """What this rank saw, naming the tensors (the manifest is built only here, on a race)."""
        ptrs = {(t.data_ptr(), t.nbytes) for t in moved}
        try:
            names = [e.name for e in prepared.manifest.entries if (_ptr(e.tensor), _nbytes(e.tensor)) in ptrs]
        except Exception:  # noqa: BLE001 - the names are a courtesy; the race stands without them
            names = []
        what = brief_names(names, 5) if names else f"{len(moved)} tensor(s)"
        return (
            f"{what} written while the overlapped audit of step {'-' if step is None else step} read them, "
            "outside the optimizer's step (which waits for the audit): not compared half-updated"
        )


def _ptr(t: Any) -> int:
    return t.data_ptr() if isinstance(t, torch.Tensor) else -1


def _nbytes(t: Any) -> int:
    return t.nbytes if isinstance(t, torch.Tensor) else -1


@dataclass(frozen=True, slots=True, eq=False)
class OverlapRun(AuditRun):
    """An :class:`AuditRun` that checks the :class:`RaceGuard` after digesting and shares a race on every rank."""

    guard: RaceGuard = field(kw_only=True)

    def raced(self, manifest: PreparedManifest) -> BaseException | None:
        """The tensors written since launch, as this rank's failure (its summary flagged failed)."""
        moved = self.guard.moved()
        return AuditRaceError(self.guard.describe(moved, manifest, self.step)) if moved else None

    def agree(self, prepared: Prepared) -> Agreement:
        """The summaries meet; a difference in values read in the window is decided at rest (every rank alike)."""
        agreement = AuditRun.agree(self, prepared)  # slots dataclass: no zero-argument super()
        if agreement.status == "values":
            said = (
                f"the overlapped read of step {'-' if self.step is None else self.step} differed between the ranks; "
                "decided at rest, where nothing writes (a write in the window that no version counter sees, through "
                ".data or a raw pointer, is never reported as a divergence)"
            )
            raise AuditRaceError(f"weightsync audit: {said}", {r: said for r in self.comm.global_ranks})
        return agreement

    def fail(self, failure: BaseException | None) -> None:
        """Every rank's reason, shared; a race on every failed rank is one :class:`AuditRaceError` everywhere."""
        mine = "" if failure is None else f"{type(failure).__name__}: {failure}"
        parts = self.comm.exchange_bytes(mine.encode(), "the failure report")
        failed = {self.comm.global_ranks[r]: b.decode("utf-8", "replace") for r, b in enumerate(parts) if b}
        if failed and all(m.startswith(RACE + ":") for m in failed.values()):
            text = "; ".join(f"rank {r}: {m[len(RACE) + 2 :]}" for r, m in failed.items())
            raise AuditRaceError(f"weightsync audit: {text}", failed)
        if failure is not None:
            raise failure
        text = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise AuditPreparationError(
            f"weightsync audit could not run because other ranks failed to prepare it: {text}", failed
        )
