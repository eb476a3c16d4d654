"""Cost of measuring a divergence's gap (``max_abs_diff``) over the data plane, against baselines.

    python benchmarks/bench_gaps.py                    # 256 MiB and 1 GiB on 2 ranks (about 2 minutes)
    python benchmarks/bench_gaps.py --mib 64 --old-max-mib 64

One float32 buffer of the given size, different on rank 1, on 2 forked gloo ranks. Each method runs on
both ranks at once, between barriers; the slowest rank's time counts:

- ``healthy audit``: ``audit()`` of the buffer when the ranks agree (digests and the summary only);
- ``diverged audit``: ``audit()`` when rank 1 differs: digests, per-tensor digests, then the reference
  copy in 4 MiB chunks from rank 0 to rank 1 over the data plane, measured chunk by chunk;
- ``plain broadcast``: ``dist.broadcast`` of the same bytes on a gloo group into a preallocated buffer
  (what moving the copy costs at the least, without any measuring);
- ``old path``: what the engine did before: the whole copy through the coordinator's star exchange,
  then float64 copies of both sides (only up to ``--old-max-mib``: it needs about 14x the tensor).

Printed: seconds (median of ``--reps``) and the peak resident memory each adds (VmHWM, max over ranks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from harness import launch, machine, median, peak_extra_bytes, table, timed
from torch import nn

from weightsync_audit import audit
from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.hashing.reader import host_bytes


def _old_gap(comm: Comm, t: torch.Tensor) -> float:
    """The engine's former phase (d): the copy through the coordinator, float64 copies of both sides."""
    blob = comm.share_bytes(0, host_bytes(t) if comm.rank == 0 else None, "the reference copy")
    theirs = torch.frombuffer(bytearray(blob), dtype=t.dtype).reshape(t.shape) if comm.rank else t
    return float((t.to(torch.float64) - theirs.to(torch.float64)).abs().max())


def _rank(rank: int, world: int, mib: int, reps: int, old: bool) -> dict[str, Any]:
    t = torch.zeros(mib << 18)
    model = nn.Module()
    model.register_buffer("w", t)
    out: dict[str, Any] = {}

    def healthy() -> None:
        assert audit(model, include=("buffers",), timeout_s=60).in_sync

    def diverged() -> None:
        r = audit(model, include=("buffers",), timeout_s=60)
        assert r.mismatches[0].max_abs_diff == 0.5, r.mismatches[0]

    pg = dist.new_group(backend="gloo")
    buf = torch.empty_like(t)

    def broadcast() -> None:
        dist.broadcast(t if rank == 0 else buf, src=0, group=pg)

    cases: list[tuple[str, Any]] = [("healthy audit", healthy)]
    for name, fn in cases:
        out[name] = (median(timed(fn, reps)), peak_extra_bytes(fn))
    if rank == 1:
        t[len(t) // 2] = 0.5
    out["diverged audit"] = (median(timed(diverged, reps)), peak_extra_bytes(diverged))
    out["plain broadcast"] = (median(timed(broadcast, reps)), peak_extra_bytes(broadcast))
    if old:
        comm = Comm(None, 600.0, grace_s=600.0)

        def old_path() -> None:
            assert _old_gap(comm, t) == (0.5 if rank else 0.0)

        out["old path"] = (median(timed(old_path, reps)), peak_extra_bytes(old_path))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--old-max-mib", type=int, default=256)
    args = ap.parse_args()
    print(machine())
    rows = []
    for mib in args.mib:
        res = launch(_rank, 2, mib, args.reps, mib <= args.old_max_mib)[0]
        base = res["plain broadcast"][0]
        for name, (secs, extra) in res.items():
            mem = "n/a" if extra is None else f"{extra / 2**20:.0f} MiB ({extra / (mib << 20):.2f}x)"
            rows.append([f"{mib} MiB", name, f"{secs:.2f}", f"{secs / base:.2f}", mem])
    print(table(["tensor", "method", "seconds", "x broadcast", "peak extra memory / rank"], rows))


if __name__ == "__main__":
    main()
