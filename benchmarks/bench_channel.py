"""Cost of the audit channel as the number of ranks grows, against bare gloo collectives in the same run.

    python benchmarks/bench_channel.py                    # 2, 4, 8, 16 and 32 ranks (about 3 minutes on 2 cores)
    python benchmarks/bench_channel.py --worlds 2 4 --reps 20

For each number of gloo ranks (forked on this machine), between barriers, slowest rank per repetition,
median repetition:

- ``all_gather 64 B`` / ``all_reduce 64 B``: bare gloo collectives of one audit summary, on the job's group;
- ``round``: the channel's healthy round alone (every rank's 64-byte summary to the coordinator, a
  fixed-size verdict back: ``engine.agreement.agree``);
- ``audit``: ``Auditor(model).audit()`` in sync on a small model (two ``Linear(8, 8)``: 4 tensors), so that
  the channel, not the hashing of 2 cores shared by up to 32 ranks, is what is measured;
- ``diverged``: an audit of 1,000 tensors of 16 floats, one of them different on the last rank (digest
  columns compared by the coordinator, the gap measured);
- ``all_gather 8 KB``: bare gloo all_gather of one rank's per-tensor digests (the diverged case's bytes).

Bytes are counted by the channel itself (``Comm.sent_bytes``): what rank 0 and the other ranks send per
healthy audit, and the most bytes through any one rank (sent + received) per diverged audit. Also: rank 0's
CPU time per healthy audit, and the time to open the audit channel (once per process).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
import torch.distributed as dist
from harness import launch, machine, median, table, timed

from weightsync_audit import Auditor
from weightsync_audit.engine.agreement.rounds import agree

N_TENSORS = 1000


def _many() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16)) for _ in range(N_TENSORS)])


def _small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))


def _rank(rank: int, world: int, reps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = _many()
    auditor = Auditor(_small(), timeout_s=300)
    comm = auditor.comm
    dist.barrier()
    t0 = time.perf_counter()
    auditor.setup()
    opened = time.perf_counter() - t0
    out: dict[str, Any] = {"open": opened}

    one = torch.zeros(8, dtype=torch.int64)
    gathered = [torch.zeros(8, dtype=torch.int64) for _ in range(world)]
    out["all_gather"] = median(timed(lambda: dist.all_gather(gathered, one), reps))
    out["all_reduce"] = median(timed(lambda: dist.all_reduce(one, op=dist.ReduceOp.MIN), reps))
    row = torch.zeros(N_TENSORS, dtype=torch.int64)
    rows = [torch.zeros(N_TENSORS, dtype=torch.int64) for _ in range(world)]
    out["all_gather_8k"] = median(timed(lambda: dist.all_gather(rows, row), reps))

    summary = np.zeros(8, dtype=np.int64)
    out["round"] = median(timed(lambda: agree(comm, summary), reps))
    assert auditor.audit().in_sync
    out["audit"] = median(timed(lambda: auditor.audit(), reps))
    sent = comm.sent_bytes
    cpu = time.process_time()
    assert auditor.audit().in_sync
    out["cpu"] = time.process_time() - cpu
    out["healthy_sent"] = comm.sent_bytes - sent

    auditor = Auditor(model, timeout_s=300)
    comm = auditor.comm
    comm.setup()  # the same audit group as above (one per set of ranks), counted from here
    if rank == world - 1:
        with torch.no_grad():
            model[N_TENSORS // 2].add_(1.0)
    result = auditor.audit()
    assert [m.ranks for m in result.mismatches] == [[world - 1]], result.mismatches
    out["diverged"] = median(timed(lambda: auditor.audit(), max(3, reps // 2)))
    sent = comm.sent_bytes
    auditor.audit()
    out["diverged_sent"] = comm.sent_bytes - sent
    return out


def _kb(n: float) -> str:
    return f"{n:.0f} B" if n < 1024 else f"{n / 1024:.1f} KB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--reps", type=int, default=0, help="repetitions (default: fewer as ranks grow)")
    args = parser.parse_args()
    print(machine())
    rows = []
    for world in args.worlds:
        reps = args.reps or max(5, 80 // world)
        res = launch(_rank, world, reps, timeout=900)
        ms = {
            k: max(r[k] for r in res) * 1e3
            for k in ("open", "all_gather", "all_reduce", "all_gather_8k", "round", "audit", "diverged")
        }
        sent0, others = res[0]["healthy_sent"], max(r["healthy_sent"] for r in res[1:])
        # Every rank but the coordinator talks only to it: rank 0 receives what the others send.
        through0 = res[0]["diverged_sent"] + sum(r["diverged_sent"] for r in res[1:])
        through_other = max(r["diverged_sent"] for r in res[1:]) + res[0]["diverged_sent"] / (world - 1)
        rows.append(
            [
                str(world),
                f"{ms['all_gather']:.2f}",
                f"{ms['all_reduce']:.2f}",
                f"{ms['round']:.2f}",
                f"{ms['audit']:.2f}",
                f"{ms['audit'] / ms['all_gather']:.2f}x",
                f"{ms['diverged']:.2f}",
                f"{ms['all_gather_8k']:.2f}",
                f"{_kb(sent0)} ({sent0 / (world - 1):.0f}/peer)",
                _kb(others),
                _kb(max(through0, through_other)),
                f"{res[0]['cpu'] * 1e3:.2f}",
                f"{ms['open']:.1f}",
            ]
        )
        print(f"{world} ranks done", flush=True)
    print()
    print(
        table(
            [
                "ranks",
                "all_gather 64 B ms",
                "all_reduce 64 B ms",
                "round ms",
                "audit ms",
                "audit / all_gather",
                "diverged ms",
                "all_gather 8 KB ms",
                "rank 0 sends, healthy",
                "other rank sends",
                "most through a rank, diverged",
                "rank 0 CPU ms",
                "open ms",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
