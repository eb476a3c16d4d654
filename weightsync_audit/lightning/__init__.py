"""The import path Lightning users write: ``weightsync_audit.lightning.pytorch_lightning`` for
``import pytorch_lightning`` and ``weightsync_audit.lightning.lightning_pytorch`` for ``import lightning.pytorch``.

The callbacks themselves live in :mod:`weightsync_audit.integrations.lightning`.
"""
