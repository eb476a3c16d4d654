"""Cost of identifying a checkpoint's files in its sidecar (``files``: size and xxh3-64 of the bytes), against
the ``torch.save`` that wrote them, in the same run.

    python benchmarks/bench_sidecar_files.py                  # 2 ranks, a 128 MiB state dict
    python benchmarks/bench_sidecar_files.py --mib 512 --reps 5

Every rank (forked gloo ranks on this machine) holds the same model of ``--mib`` MiB of float32 parameters.
Per repetition, timed on all ranks at once between barriers, slowest rank, median printed:

- ``save``: ``torch.save(model.state_dict(), path)`` on rank 0 (the baseline: what a checkpoint costs);
- ``files``: listing and digesting that file as the sidecar does (:func:`list_files` + :func:`complete_files`
  on rank 0, the file just written, so read from the page cache as after a real save);
- ``sidecar``: the whole ``Auditor.checkpoint_saved`` (a full audit, the tensor digests, the files, the write).

``files / save`` is what identifying the file adds to writing it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from harness import launch, machine, median, own_copy, table, timed

from weightsync_audit import Auditor
from weightsync_audit.engine.checkpoints.folder import complete_files, list_files


def _rank(rank: int, world: int, mib: int, reps: int, folder: str) -> list[str]:
    torch.manual_seed(0)
    side = int((mib * 2**20 / 4 / 8) ** 0.5)
    model = own_copy(torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(8)]))
    auditor = Auditor(model)
    path = os.path.join(folder, "model.pt")

    def save() -> None:
        if rank == 0:
            torch.save(model.state_dict(), path)
        dist.barrier()

    def files() -> None:
        if rank == 0:
            complete_files(path, list_files(path) or {}, {})
        dist.barrier()

    save_s = median(timed(save, reps))
    files_s = median(timed(files, reps))
    sidecar_s = median(timed(lambda: auditor.checkpoint_saved(path, 1), reps))
    size = os.path.getsize(path) / 2**20
    return [
        f"{size:.0f}",
        f"{save_s * 1e3:.1f}",
        f"{files_s * 1e3:.1f}",
        f"{sidecar_s * 1e3:.1f}",
        f"{files_s / save_s:.2f}",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        row: Any = launch(_rank, args.world, args.mib, args.reps, folder)[0]
    print(machine())
    print(f"{args.world} ranks; median of {args.reps}")
    print(table(["file MiB", "save ms", "files ms", "checkpoint_saved ms", "files / save"], [row]))


if __name__ == "__main__":
    main()
