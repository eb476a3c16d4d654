"""One rank of a job whose ranks run different releases of weightsync_audit (PYTHONPATH picks which).

Prints ``result: <what the audit did>`` and exits 0 whatever the audit raised; a rank that aborts (gloo
terminating the process on a frame longer than its receive buffer) never prints it.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    import weightsync_audit

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    try:
        r = weightsync_audit.audit(model, timeout_s=20)
        what = f"in_sync={r.in_sync}"
    except Exception as exc:  # noqa: BLE001 - what each rank did is the test's subject
        what = type(exc).__name__
    print(f"result: {what} from {os.path.dirname(weightsync_audit.__file__)}", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
