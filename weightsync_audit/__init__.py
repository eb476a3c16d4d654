"""weightsync_audit: are your data-parallel replicas still holding the same weights?

>>> import torch
>>> from weightsync_audit import audit
>>> audit(torch.nn.Linear(2, 2)).in_sync
True
"""

from weightsync_audit.auditor import AuditConfig, AuditHistory, Auditor, audit
from weightsync_audit.ddp import rewrap_ddp
from weightsync_audit.errors import (
    AuditOutOfStepError,
    AuditPreparationError,
    AuditTimeoutError,
    ReportFormatError,
    UnauditableTensorError,
    WeightDivergenceError,
    WeightSyncAuditError,
)
from weightsync_audit.result import SCHEMA, AuditResult, Mismatch
from weightsync_audit.resync import resync

__version__ = "0.1.0"

__all__ = [
    "SCHEMA",
    "AuditConfig",
    "AuditHistory",
    "AuditOutOfStepError",
    "AuditPreparationError",
    "AuditResult",
    "AuditTimeoutError",
    "Auditor",
    "Mismatch",
    "ReportFormatError",
    "UnauditableTensorError",
    "WeightDivergenceError",
    "WeightSyncAuditError",
    "audit",
    "resync",
    "rewrap_ddp",
]


def __getattr__(name: str) -> object:
    # The Lightning callbacks import Lightning; load them only when asked for.
    if name in ("WeightSyncAudit", "DDPRewrapOnTrainableChange"):
        from weightsync_audit.lightning import pytorch_lightning as _pl

        return getattr(_pl, name)
    raise AttributeError(f"module 'weightsync_audit' has no attribute {name!r}")
