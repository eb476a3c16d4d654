"""A plain script, launched like torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment),
that audits (a healthy and a diverged audit: the audit group, the digest threads) and then just exits.

Usage: python audit_and_exit.py destroy|keep
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from weightsync_audit import Auditor

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))  # 4 MiB: digest threads
    auditor = Auditor(model, timeout_s=30)
    assert auditor.audit(step=0).in_sync
    if dist.get_rank() == 1:
        with torch.no_grad():
            model[1].bias[0] += 1
    assert not auditor.audit(step=1).in_sync
    if sys.argv[1] == "destroy":
        dist.destroy_process_group()
    print("done", dist.get_rank() if sys.argv[1] == "keep" else "", flush=True)
