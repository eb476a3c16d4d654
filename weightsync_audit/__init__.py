"""weightsync_audit: are your data-parallel replicas still holding the same weights?

>>> import torch
>>> from weightsync_audit import audit
>>> audit(torch.nn.Linear(2, 2)).in_sync
True

Every public name loads on first use (PEP 562), so ``import weightsync_audit`` costs next to nothing
and reading a report (``weightsync-audit check``) never imports torch; the Lightning callbacks load
only when asked for, so the core never imports Lightning.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:
    from weightsync_audit.ddp.rewrap import maybe_rewrap, rewrap_ddp
    from weightsync_audit.engine.attribution import AttributionConfig
    from weightsync_audit.engine.attribution.settle import attach_watch
    from weightsync_audit.engine.auditor import AuditConfig, AuditHistory, Auditor, audit
    from weightsync_audit.engine.checkpoints.resume_state import ResumeSources
    from weightsync_audit.engine.overlap import PendingAudit
    from weightsync_audit.engine.repair.resync import resync
    from weightsync_audit.errors import (
        AuditOutOfStepError,
        AuditPreparationError,
        AuditRaceError,
        AuditTimeoutError,
        ReportFormatError,
        ResyncError,
        TrainableSetMismatchError,
        UnauditableTensorError,
        WeightDivergenceError,
        WeightSyncAuditError,
        WeightSyncWarning,
    )
    from weightsync_audit.integrations.loop import LoopAudit
    from weightsync_audit.integrations.session.options import AuditOptions
    from weightsync_audit.lightning.pytorch_lightning import DDPRewrapOnTrainableChange, WeightSyncAudit
    from weightsync_audit.reporting.jsonl import ReportContents, ReportWriter, read_report
    from weightsync_audit.reporting.record import SCHEMA, AuditResult, Mismatch
    from weightsync_audit.reporting.render import render
    from weightsync_audit.reporting.terminal import print_report

__version__ = "0.1.0"

_ERRORS = "weightsync_audit.errors"
_LAZY = {
    "maybe_rewrap": "weightsync_audit.ddp.rewrap",
    "rewrap_ddp": "weightsync_audit.ddp.rewrap",
    "AuditConfig": "weightsync_audit.engine.auditor",
    "AttributionConfig": "weightsync_audit.engine.attribution",
    "attach_watch": "weightsync_audit.engine.attribution.settle",
    "AuditHistory": "weightsync_audit.engine.auditor",
    "Auditor": "weightsync_audit.engine.auditor",
    "audit": "weightsync_audit.engine.auditor",
    "resync": "weightsync_audit.engine.repair.resync",
    "declare_replicas": "weightsync_audit.engine.inventory.layouts",
    "AuditOutOfStepError": _ERRORS,
    "AuditPreparationError": _ERRORS,
    "AuditRaceError": _ERRORS,
    "AuditTimeoutError": _ERRORS,
    "ReportFormatError": _ERRORS,
    "ResyncError": _ERRORS,
    "TrainableSetMismatchError": _ERRORS,
    "UnauditableTensorError": _ERRORS,
    "WeightDivergenceError": _ERRORS,
    "WeightSyncAuditError": _ERRORS,
    "WeightSyncWarning": _ERRORS,
    "SCHEMA": "weightsync_audit.reporting.record",
    "AuditResult": "weightsync_audit.reporting.record",
    "Mismatch": "weightsync_audit.reporting.record",
    "ReportWriter": "weightsync_audit.reporting.jsonl",
    "ReportContents": "weightsync_audit.reporting.jsonl",
    "read_report": "weightsync_audit.reporting.jsonl",
    "render": "weightsync_audit.reporting.render",
    "print_report": "weightsync_audit.reporting.terminal",
    "LoopAudit": "weightsync_audit.integrations.loop",
    "AuditOptions": "weightsync_audit.integrations.session.options",
    "ResumeSources": "weightsync_audit.engine.checkpoints.resume_state",
    "PendingAudit": "weightsync_audit.engine.overlap",
    # The callbacks for `import pytorch_lightning`; `lightning.pytorch` users import them from
    # weightsync_audit.lightning.lightning_pytorch.
    "WeightSyncAudit": "weightsync_audit.lightning.pytorch_lightning",
    "DDPRewrapOnTrainableChange": "weightsync_audit.lightning.pytorch_lightning",
}

__all__ = [
    "SCHEMA",
    "AttributionConfig",
    "AuditConfig",
    "AuditHistory",
    "AuditOptions",
    "AuditOutOfStepError",
    "AuditPreparationError",
    "AuditRaceError",
    "AuditResult",
    "AuditTimeoutError",
    "Auditor",
    "DDPRewrapOnTrainableChange",
    "LoopAudit",
    "Mismatch",
    "PendingAudit",
    "ReportContents",
    "ReportFormatError",
    "ReportWriter",
    "TrainableSetMismatchError",
    "ResyncError",
    "ResumeSources",
    "UnauditableTensorError",
    "WeightDivergenceError",
    "WeightSyncAudit",
    "WeightSyncAuditError",
    "WeightSyncWarning",
    "attach_watch",
    "audit",
    "declare_replicas",
    "maybe_rewrap",
    "print_report",
    "read_report",
    "render",
    "resync",
    "rewrap_ddp",
]


def lazy_names(
    package: str, homes: Mapping[str, str], extras: Mapping[str, str] | None = None
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """PEP 562 for a package whose public names load on first use (this one, ``metrics``, ``torchft``): its
    ``__getattr__`` (``homes``: name -> the module that defines it, imported at the name's first use, the
    value kept) and its ``__dir__``. ``extras``: name -> the extra that installs what its module imports."""
    space = sys.modules[package].__dict__

    def load(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            space[name] = value = getattr(importlib.import_module(homes[name]), name)  # loaded once
        except ImportError as exc:
            if not extras or name not in extras:
                raise
            raise ImportError(
                f"{package}.{name} needs {exc.name or 'its package'}, the extra weightsync-audit[{extras[name]}] "
                "(docs/metrics.md)"
            ) from exc
        return value

    return load, lambda: sorted({*space, *space["__all__"]})


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
