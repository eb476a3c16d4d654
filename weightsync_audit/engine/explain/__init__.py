"""The explain phase: why replicas differ, in words, from the evidence an audit gathered.

:class:`Evidence` (``evidence``) holds what the hints reason from: the mismatches, the live DDP wrapper
and what its reducer covers, the optimizer state compared, the proven #20340 words shared with the DDP
watch, parameters that followed unreduced ones; :func:`explain` (``hints``) asks every rule in order: one
rule per cause (``rules``), DeepSpeed ZeRO's master check and a differing parameter under a sharding engine
(``hints``).
"""

from weightsync_audit.engine.explain.evidence import Evidence
from weightsync_audit.engine.explain.hints import explain

__all__ = ["Evidence", "explain"]
