"""A torchrun worker for the ``weightsync-audit launch`` tests. Usage: launch_worker.py MODE OUT

- ``hang``: write ``OUT/pid.rank<r>`` and wait forever.
- ``unwritable``: 2 gloo ranks under ``LoopAudit(on_mismatch="raise", exit_code=17)``; rank 0 replaces the
  evict file's folder by a file (a shared folder gone, a full disk), rank 1's weights are nudged: every rank
  exits 17 while no evict file can be written.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def hang(out: Path) -> None:
    rank = int(os.environ["RANK"])
    (out / f"pid.rank{rank}").write_text(str(os.getpid()))
    while True:
        time.sleep(1)


def unwritable(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from weightsync_audit import LoopAudit

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    audit = LoopAudit(model, on_mismatch="raise", exit_code=17, verbose=False, timeout_s=60)
    assert audit.audit(step=0) is not None  # opened with the evict folder in place
    if rank == 0:  # the test's own hand-off folder (under OUT) moved aside, a file in its place: nothing deleted
        folder = Path(os.environ["WEIGHTSYNC_EVICT_FILE"]).parent
        assert folder == out / "handoff", folder
        folder.rename(out / "handoff.moved")
        folder.write_text("a file where the evict file's folder was\n")
    dist.barrier()
    if rank == 1:
        with torch.no_grad():
            model.weight[0, 0] += 1.0
    audit.audit(step=1)  # every rank exits 17 here
    (out / f"survived.rank{rank}").write_text("the audit did not end the process\n")


if __name__ == "__main__":
    {"hang": hang, "unwritable": unwritable}[sys.argv[1]](Path(sys.argv[2]))
