"""weightsync_audit: are your data-parallel replicas still holding the same weights?

>>> import torch
>>> from weightsync_audit import audit
>>> audit(torch.nn.Linear(2, 2)).in_sync
True

The Lightning callbacks load on first use, so the core never imports Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from weightsync_audit.ddp.rewrap import maybe_rewrap, rewrap_ddp

# `resync` is both a submodule and a function: importing the function eagerly keeps the package
# attribute bound to the function (a lazy import would let the submodule shadow it).
from weightsync_audit.engine.auditor import AuditConfig, AuditHistory, Auditor, audit
from weightsync_audit.engine.inventory.replicas import declare_replicas
from weightsync_audit.engine.repair.resync import resync
from weightsync_audit.errors import (
    AuditOutOfStepError,
    AuditPreparationError,
    AuditTimeoutError,
    ReportFormatError,
    ResyncError,
    TrainableSetMismatchError,
    UnauditableTensorError,
    WeightDivergenceError,
    WeightSyncAuditError,
    WeightSyncWarning,
)
from weightsync_audit.reporting.record import SCHEMA, AuditResult, Mismatch

if TYPE_CHECKING:
    from weightsync_audit.integrations.lightning.pytorch_lightning import DDPRewrapOnTrainableChange, WeightSyncAudit

__version__ = "0.1.0"

_LAZY = {
    # The callbacks for `import pytorch_lightning`; `lightning.pytorch` users import them from
    # weightsync_audit.integrations.lightning.lightning_pytorch.
    "WeightSyncAudit": "weightsync_audit.integrations.lightning.pytorch_lightning",
    "DDPRewrapOnTrainableChange": "weightsync_audit.integrations.lightning.pytorch_lightning",
}

__all__ = [
    "SCHEMA",
    "AuditConfig",
    "AuditHistory",
    "AuditOutOfStepError",
    "AuditPreparationError",
    "AuditResult",
    "AuditTimeoutError",
    "Auditor",
    "DDPRewrapOnTrainableChange",
    "Mismatch",
    "ReportFormatError",
    "TrainableSetMismatchError",
    "ResyncError",
    "UnauditableTensorError",
    "WeightDivergenceError",
    "WeightSyncAudit",
    "WeightSyncAuditError",
    "WeightSyncWarning",
    "audit",
    "declare_replicas",
    "maybe_rewrap",
    "resync",
    "rewrap_ddp",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync_audit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
