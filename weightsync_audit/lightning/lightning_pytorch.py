"""The callbacks for ``import lightning.pytorch as pl``."""

from __future__ import annotations

from lightning.pytorch import Callback

from weightsync_audit.lightning._audit_callback import WeightSyncAuditMixin

__all__ = ["WeightSyncAudit"]


class WeightSyncAudit(WeightSyncAuditMixin, Callback):
    __doc__ = WeightSyncAuditMixin.__doc__
