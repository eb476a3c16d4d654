"""``WeightSyncAuditCallback`` for the Hugging Face ``transformers.Trainer`` (defined in :mod:`weightsync_audit.integrations.transformers`)."""

from weightsync_audit.integrations.transformers import WeightSyncAuditCallback

__all__ = ["WeightSyncAuditCallback"]
