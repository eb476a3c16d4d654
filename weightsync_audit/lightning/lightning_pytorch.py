"""``WeightSyncAudit`` and ``DDPRewrapOnTrainableChange`` for ``import lightning.pytorch`` (without it installed, the import
says what to install)."""

from __future__ import annotations

from weightsync_audit.lightning import callback_classes

__all__ = ["DDPRewrapOnTrainableChange", "WeightSyncAudit"]

WeightSyncAudit, DDPRewrapOnTrainableChange = callback_classes("lightning.pytorch", __name__)
