"""The callbacks for ``import pytorch_lightning as pl``."""

from __future__ import annotations

from pytorch_lightning import Callback

from weightsync_audit.integrations.lightning.audit_callback import WeightSyncAuditMixin
from weightsync_audit.integrations.lightning.rewrap_callback import DDPRewrapMixin

__all__ = ["DDPRewrapOnTrainableChange", "WeightSyncAudit"]


class WeightSyncAudit(WeightSyncAuditMixin, Callback):
    __doc__ = WeightSyncAuditMixin.__doc__


class DDPRewrapOnTrainableChange(DDPRewrapMixin, Callback):
    __doc__ = DDPRewrapMixin.__doc__
