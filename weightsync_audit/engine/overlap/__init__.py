"""The overlapped audit (``overlap=True``): step s digested and compared while step s+1 runs, settled
before the next optimizer step (:mod:`~weightsync_audit.engine.overlap.window`); a write inside the window
named, never compared half-updated (:mod:`~weightsync_audit.engine.overlap.race`); on an accelerator a
side stream ordered after the step by an event (``StreamOrder``)."""

from weightsync_audit.engine.overlap.window import OverlapWindow, PendingAudit

__all__ = ["OverlapWindow", "PendingAudit"]
