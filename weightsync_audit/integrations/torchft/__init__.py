"""torchft: audits across fault-tolerant replica groups (an optional extra; the core never imports it).

:class:`TorchFTAudit` hooks a replica group's torchft ``Manager`` and audits the replica groups of the
current quorum among themselves: before committed steps (DDP, HSDP), right after a replica heals from a
live peer (verified against its source before its first committed step), and at LocalSGD/DiLoCo sync
points only. torchft itself is imported by none of it: it reads the objects it is handed. The names load
on first use (PEP 562). See docs/torchft.md.

>>> from weightsync_audit.integrations.torchft import TorchFTAudit
>>> TorchFTAudit.__name__
'TorchFTAudit'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync_audit import lazy_names

if TYPE_CHECKING:
    from weightsync_audit.integrations.torchft.audit import DEFAULT_EVERY_N_STEPS, TorchFTAudit
    from weightsync_audit.integrations.torchft.compat import TorchFTCompatError

_LAZY = {
    "DEFAULT_EVERY_N_STEPS": "weightsync_audit.integrations.torchft.audit",
    "TorchFTAudit": "weightsync_audit.integrations.torchft.audit",
    "TorchFTCompatError": "weightsync_audit.integrations.torchft.compat",
}

__all__ = ["DEFAULT_EVERY_N_STEPS", "TorchFTAudit", "TorchFTCompatError"]

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
