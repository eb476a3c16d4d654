"""Lightning adapters: one callback class per namespace over a shared, Lightning-free mixin.

``weightsync_audit.lightning.pytorch_lightning`` serves ``import pytorch_lightning``;
``weightsync_audit.lightning.lightning_pytorch`` serves ``import lightning.pytorch``.
"""
