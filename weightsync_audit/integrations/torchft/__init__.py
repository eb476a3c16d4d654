"""torchft: audits across fault-tolerant replica groups (an optional extra; the core never imports it).

:class:`TorchFTAudit` hooks a replica group's torchft ``Manager`` and audits the replica groups of the
current quorum among themselves: before committed steps (DDP, HSDP), right after a replica heals from a
live peer (verified against its source before its first committed step), and at LocalSGD/DiLoCo sync
points only. torchft itself is not imported by this package: it reads the objects it is handed.
See docs/torchft.md.
"""

from weightsync_audit.integrations.torchft.audit import TorchFTAudit
from weightsync_audit.integrations.torchft.compat import TorchFTCompatError

__all__ = ["TorchFTAudit", "TorchFTCompatError"]
