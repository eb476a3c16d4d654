"""``WeightSyncAudit`` and ``DDPRewrapOnTrainableChange`` for ``import lightning.pytorch`` (defined in :mod:`weightsync_audit.integrations.lightning.lightning_pytorch`)."""

from weightsync_audit.integrations.lightning.lightning_pytorch import DDPRewrapOnTrainableChange, WeightSyncAudit

__all__ = ["DDPRewrapOnTrainableChange", "WeightSyncAudit"]
