"""Cost of ``LoopAudit(check_batches=True)``: the batch digest and its round, against the audit it rides with.

    python benchmarks/bench_duplicate_batches.py                 # 2 ranks, the batches below
    python benchmarks/bench_duplicate_batches.py --world 4 --reps 15

Every rank (forked gloo ranks on this machine) holds a model of about 8.4M float32 parameters and, per
case, one batch: ``tokens`` (32 x 512 int64, a language-model batch), ``images`` (32 x 3 x 224 x 224
float32). Timed on all ranks at once between barriers, slowest rank per repetition, median printed:

- ``audit``: ``Auditor(model).audit()`` (what an audited step costs already);
- ``digest``: :func:`batch_digest` of the batch alone (local);
- ``check``: the whole check: digest + one round of the audit channel.

The ratio ``check / audit`` is the check's share of an audited step's audit, in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch
from harness import launch, machine, median, own_copy, table, timed

from weightsync_audit import Auditor
from weightsync_audit.engine.timeline.step_records import batch_digest, shared_batches

BATCHES = {
    "tokens": lambda: torch.randint(0, 50_000, (32, 512)),
    "images": lambda: torch.randn(32, 3, 224, 224),
}


def _rank(rank: int, world: int, reps: int) -> list[list[str]]:
    torch.manual_seed(0)
    model = own_copy(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]))
    auditor = Auditor(model)
    auditor.setup()
    rows = []
    for name, make in BATCHES.items():
        torch.manual_seed(rank)
        batch = make()
        audit_s = median(timed(lambda: auditor.audit(step=0), reps))
        digest_s = median(timed(lambda b=batch: batch_digest(b), reps))
        check_s = median(timed(lambda b=batch: shared_batches(auditor.comm, batch_digest(b)), reps))
        mb = batch.numel() * batch.element_size() / 2**20
        rows.append([
            name, f"{mb:.1f}", f"{audit_s * 1e3:.2f}", f"{digest_s * 1e3:.2f}", f"{check_s * 1e3:.2f}",
            f"{check_s / audit_s:.2f}",
        ])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args(argv)
    rows: Any = launch(_rank, args.world, args.reps)[0]
    print(machine())
    print(f"{args.world} ranks; model 8.4M float32 parameters; median of {args.reps}")
    print(table(["batch", "MiB per rank", "audit ms", "digest ms", "check ms", "check / audit"], rows))


if __name__ == "__main__":
    main()
