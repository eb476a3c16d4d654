"""``WeightSyncAuditCallback`` for the Hugging Face ``transformers.Trainer`` (defined in :mod:`weightsync_audit.integrations.hf.callback`)."""

from weightsync_audit.integrations.hf.callback import TRAINER_FIX, WeightSyncAuditCallback

__all__ = ["TRAINER_FIX", "WeightSyncAuditCallback"]
