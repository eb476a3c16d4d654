"""Memory and speed of ``verify`` and ``diff`` on a large checkpoint, against reading its bytes.

    python benchmarks/bench_checkpoint_read.py               # a 1 GiB checkpoint, 16 tensors of 64 MiB
    python benchmarks/bench_checkpoint_read.py --mib 256 --tensors 8

For each format (a ``.safetensors`` file, a ``torch.save`` zip file), in a fresh process each:

- ``read``: the file's bytes read in 16 MiB blocks into one buffer (the read bandwidth of the same file; the page cache is
  warm for every row alike: the file was just written or read);
- ``verify``: ``verify_checkpoint`` (each file's digest, then each tensor's digest, one tensor at a time);
- ``diff``: ``diff_checkpoints`` of the file against a copy of it (tensor by tensor, both sides).

Printed per row: seconds, GiB/s of checkpoint bytes (``diff`` counts both sides), and the peak of the
process's anonymous memory above what it held before (``RssAnon``, sampled every 2 ms: the heap and torch's
allocations; the pages of a memory-mapped file are the kernel's page cache, reclaimable, and not counted),
next to the largest tensor. The claim checked: peak <= largest tensor + 64 MiB and throughput >= half of
``read``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _anon_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def _measured(fn) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    base, peak, stop = _anon_kib(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _anon_kib())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.perf_counter()
    fn()
    took = time.perf_counter() - start
    stop.set()
    t.join()
    return took, max(0, max(peak[0], _anon_kib()) - base) << 10


def _child(what: str, path: str, other: str) -> None:
    from weightsync_audit.engine.checkpoints.diff import diff_checkpoints
    from weightsync_audit.engine.checkpoints.offline import verify_checkpoint

    def read() -> None:  # the best a reader can do: one reused buffer, no allocation per block
        buf = bytearray(16 << 20)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    def verify() -> None:
        assert verify_checkpoint(path)["status"] == "verified"

    def diff() -> None:
        assert diff_checkpoints(path, other).identical

    took, peak = _measured({"read": read, "verify": verify, "diff": diff}[what])
    print(json.dumps({"s": took, "peak": peak}))


def _make(folder: Path, fmt: str, mib: int, tensors: int) -> Path:
    import torch

    from weightsync_audit import Auditor

    torch.manual_seed(0)
    n = mib * 2**20 // 4 // tensors
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for _ in range(tensors)])
    path = folder / ("model.safetensors" if fmt == "safetensors" else "model.pt")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(dict(model.state_dict()), str(path))
    else:
        torch.save(model.state_dict(), path)
    Auditor(model).checkpoint_saved(path, 1)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return
    largest = args.mib * 2**20 // args.tensors
    print(f"{args.mib} MiB in {args.tensors} tensors (largest {largest >> 20} MiB)")
    print(f"{'format':<12} {'row':<7} {'s':>7} {'GiB/s':>7} {'peak MiB':>9}  claim")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("safetensors", "torch.save"):
            folder = Path(tmp) / fmt.replace(".", "_")
            (folder / "b").mkdir(parents=True)
            path = _make(folder, fmt, args.mib, args.tensors)
            other = folder / "b" / path.name
            shutil.copy(path, other)
            size = path.stat().st_size
            base = None
            for row in ("read", "verify", "diff"):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", row, str(path), str(other)],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                got = json.loads(out.stdout.strip().splitlines()[-1])
                rate = size * (2 if row == "diff" else 1) / got["s"] / 2**30
                base = rate if row == "read" else base
                ok = "" if row == "read" else ("ok" if got["peak"] <= largest + (64 << 20) else "PEAK OVER")
                if row != "read" and base is not None and rate < base / 2:
                    ok += " SLOWER THAN HALF"
                print(f"{fmt:<12} {row:<7} {got['s']:>7.2f} {rate:>7.2f} {got['peak'] / 2**20:>9.0f}  {ok}")


if __name__ == "__main__":
    main()
