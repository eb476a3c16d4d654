"""Peak host memory of ``method="xxh3"`` on accelerator tensors, with stand-ins on the CPU.

    python benchmarks/bench_device_xxh3.py                  # 96 MiB in 4 tensors, full and 1/8 coverage
    WEIGHTSYNC_AUDIT_THREADS=4 python benchmarks/bench_device_xxh3.py --mib 384

The tensors are ``tests/fakedevice.FakeAccel``: not on the CPU, and read only through copies to the host,
as accelerator tensors are; each copy is counted. Prints the peak extra resident memory of one
``digest_tensors`` call (VmHWM over the resident size before it), the bytes copied and the largest copy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: F401 - first: it puts this checkout and tests/ on sys.path
import torch
from fakedevice import COPIED, fake, reset_copies
from harness import machine, peak_extra_bytes, table

from weightsync_audit.engine.hashing.digest import digest_tensors, workers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=96, help="total size of the stand-in device tensors")
    p.add_argument("--tensors", type=int, default=4)
    args = p.parse_args()
    print(f"# {machine()}; hashing threads: {workers()}")
    per = (args.mib << 20) // args.tensors // 4
    tensors = [fake(torch.randn(per)) for _ in range(args.tensors)]
    digest_tensors([fake(torch.ones(10))], method="xxh3")  # warm: lazy imports, the thread pool
    rows = []
    for slices in (1, 8):
        reset_copies()
        extra = peak_extra_bytes(lambda slices=slices: digest_tensors(tensors, method="xxh3", slices=slices))
        rows.append(
            [
                f"{args.mib} MiB / {args.tensors} tensors",
                "full" if slices == 1 else f"1/{slices}",
                "n/a" if extra is None else f"{extra / 2**20:.1f} MiB",
                f"{COPIED['bytes'] / 2**20:.1f} MiB in {COPIED['copies']} copies",
                f"{COPIED['largest'] / 2**20:.1f} MiB",
            ]
        )
    print(table(["device tensors", "coverage", "peak extra host memory", "copied to host", "largest copy"], rows))


if __name__ == "__main__":
    main()
