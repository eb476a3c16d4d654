"""``WeightSyncAudit`` and ``DDPRewrapOnTrainableChange`` for ``import lightning.pytorch`` (without it installed, the import
says what to install)."""

from __future__ import annotations

from weightsync_audit.integrations.lightning.audit_callback import WeightSyncAuditMixin
from weightsync_audit.integrations.lightning.rewrap_callback import DDPRewrapMixin
from weightsync_audit.lightning import callback_base

__all__ = ["DDPRewrapOnTrainableChange", "WeightSyncAudit"]

Callback = callback_base("lightning.pytorch")


class WeightSyncAudit(WeightSyncAuditMixin, Callback):  # type: ignore[misc, valid-type]
    __doc__ = WeightSyncAuditMixin.__doc__


class DDPRewrapOnTrainableChange(DDPRewrapMixin, Callback):  # type: ignore[misc, valid-type]
    __doc__ = DDPRewrapMixin.__doc__
