"""``WeightSyncAuditCallback`` for the Hugging Face ``transformers.Trainer`` (defined in :mod:`weightsync_audit.integrations.transformers`)."""

from weightsync_audit.integrations.transformers import TRAINER_FIX, WeightSyncAuditCallback

__all__ = ["TRAINER_FIX", "WeightSyncAuditCallback"]
