"""``WeightSyncAudit`` and ``DDPRewrapOnTrainableChange`` for ``import pytorch_lightning`` (defined in :mod:`weightsync_audit.integrations.lightning.pytorch_lightning`)."""

from weightsync_audit.integrations.lightning.pytorch_lightning import DDPRewrapOnTrainableChange, WeightSyncAudit

__all__ = ["DDPRewrapOnTrainableChange", "WeightSyncAudit"]
