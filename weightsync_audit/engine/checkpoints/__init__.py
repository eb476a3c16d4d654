"""Verified checkpoints: a sidecar written beside each checkpoint, checked when the checkpoint is loaded."""
