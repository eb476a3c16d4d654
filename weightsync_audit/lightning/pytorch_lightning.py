"""The callbacks for ``import pytorch_lightning as pl``."""

from __future__ import annotations

from pytorch_lightning import Callback

from weightsync_audit.lightning._audit_callback import WeightSyncAuditMixin

__all__ = ["WeightSyncAudit"]


class WeightSyncAudit(WeightSyncAuditMixin, Callback):
    __doc__ = WeightSyncAuditMixin.__doc__
