"""The Hugging Face ``transformers.Trainer`` adapter: the callback (:mod:`.callback`, the only module of the
package that imports ``transformers``) and what the Trainer trains with (:mod:`.engines`). Users import
``from weightsync_audit.transformers import WeightSyncAuditCallback``.
"""
