"""``WeightSyncAudit`` and ``DDPRewrapOnTrainableChange`` for ``import pytorch_lightning`` (without it installed, the import
says what to install)."""

from __future__ import annotations

from weightsync_audit.lightning import callback_classes

__all__ = ["DDPRewrapOnTrainableChange", "WeightSyncAudit"]

WeightSyncAudit, DDPRewrapOnTrainableChange = callback_classes("pytorch_lightning", __name__)
