"""The Hugging Face ``transformers.Trainer`` adapter: the callback (:mod:`.callback`, the only module of the
package that imports ``transformers``) and what its arguments and state say (:mod:`.engines`: its engine, the folder it resumes from). Users import
``from weightsync_audit.transformers import WeightSyncAuditCallback``.
"""
