"""On-device digest throughput on a GPU, against the HBM copy rate and Megatron-LM's host-copy method.

    python benchmarks/gpu_digest.py                         # 1, 4 and 10 GB models, bf16 and fp32
    python benchmarks/gpu_digest.py --sizes-gb 2 --dtypes bf16 --megatron-max-gb 2
    python benchmarks/gpu_digest.py --device cpu --sizes-gb 0.05   # a dry run of this script without a GPU

Per model (GPT-shaped tensors of the requested total size, on one device) it prints the median time of:

- ``copy``: ``dst.copy_(src)`` of every tensor into a preallocated twin (the HBM bandwidth limit: reads and
  writes every byte once);
- ``digest``: ``weightsync_audit.engine.hashing.digest.device_digests`` (the audit's path for accelerator tensors,
  including its single device-to-host transfer), in eager mode, and with the opt-in fused kernel
  (``WEIGHTSYNC_AUDIT_COMPILE=1``: ``torch.compile``; its one-off compile time is not in the figure,
  its digests are checked equal to eager mode's);
- ``megatron``: ``sha1(param.to("cpu").float().numpy())`` per tensor (Megatron-LM's check), timed on
  models up to ``--megatron-max-gb`` only (it takes seconds per GB);

and the peak extra device memory of the digest. It also checks, bit for bit, that the digests computed on
the device equal the same method's digests computed on a CPU copy (the digest is exact integer
arithmetic, so it must not depend on where or in which order it was reduced), and reports kernel
launches per step (the eager implementation issues about 15 elementwise kernels per step of
``_DEVICE_WORDS_ACCEL`` words).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from harness import machine, table

from weightsync_audit.engine.hashing import digest as D


def make_tensors(total_bytes: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """Transformer blocks of width ``d`` (d x 3d, d x d, d x 4d, 4d x d, and their vectors) up to ``total_bytes``."""
    esize = torch.empty((), dtype=dtype).element_size()
    d = 4096
    while d > 64 and 12 * d * d * esize > total_bytes:
        d //= 2
    shapes = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    block = sum(esize * (a * (b[0] if b else 1)) for a, *b in shapes)
    g = torch.Generator(device=device).manual_seed(0)
    return [
        torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1, generator=g)
        for _ in range(max(1, total_bytes // block))
        for shape in shapes
    ]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, reps: int) -> float:
    fn()
    sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def set_compiled(on: bool) -> None:
    """Switch the digest's opt-in fused kernel on or off for the calls that follow."""
    if on:
        os.environ["WEIGHTSYNC_AUDIT_COMPILE"] = "1"
    else:
        os.environ.pop("WEIGHTSYNC_AUDIT_COMPILE", None)
    D._compile_state = "untried"


def megatron(tensors: list[torch.Tensor]) -> list[bytes]:
    return [hashlib.sha1(t.data.to("cpu").float().numpy(force=True)).digest() for t in tensors]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-gb", default="1,4,10")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--megatron-max-gb", type=float, default=1.0)
    p.add_argument("--no-compiled", dest="compiled", action="store_false", help="skip the torch.compile variant")
    args = p.parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu for a dry run")
    where = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU (dry run)"
    print(f"# {machine()}; device: {where}", flush=True)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    rows = []
    for name in args.dtypes.split(","):
        for gb in (float(x) for x in args.sizes_gb.split(",")):
            tensors = make_tensors(int(gb * 1e9), dtypes[name], device)
            size = sum(t.nbytes for t in tensors)
            twins = [torch.empty_like(t) for t in tensors]

            def copy(tensors: list[torch.Tensor] = tensors, twins: list[torch.Tensor] = twins) -> None:
                for a, b in zip(twins, tensors):
                    a.copy_(b)

            t_copy = timed(copy, device, args.reps)
            del twins
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            set_compiled(False)
            eager = D.device_digests(tensors)
            t_digest = timed(lambda tensors=tensors: D.device_digests(tensors), device, args.reps)
            peak = torch.cuda.max_memory_allocated() - base if device.startswith("cuda") else None
            t_fused, fused_ok = None, "-"
            if args.compiled:
                set_compiled(True)
                try:
                    fused_ok = "yes" if D.device_digests(tensors) == eager else "NO"
                    if D._compile_state == "on":
                        t_fused = timed(lambda tensors=tensors: D.device_digests(tensors), device, args.reps)
                    else:
                        fused_ok = f"not compiled ({D._compile_state})"
                finally:
                    set_compiled(False)
            # Exact and placement-independent: the same digests from a CPU copy (a few tensors: it is slow there).
            few = [tensors[0], tensors[1], tensors[-1]]
            same = D.device_digests(few) == D.device_digests([t.cpu() for t in few])
            t_meg = timed(lambda tensors=tensors: megatron(tensors), device, 1) if gb <= args.megatron_max_gb else None
            rows.append(
                [
                    name,
                    f"{size / 1e9:.2f} GB / {len(tensors)} tensors",
                    f"{t_copy * 1e3:.1f} ms ({size / t_copy / 1e9:.0f} GB/s)",
                    f"{t_digest * 1e3:.1f} ms ({size / t_digest / 1e9:.0f} GB/s)",
                    f"{100 * t_copy / t_digest:.0f}%",
                    f"{t_fused * 1e3:.1f} ms ({size / t_fused / 1e9:.0f} GB/s, {100 * t_copy / t_fused:.0f}% of copy)"
                    if t_fused
                    else fused_ok,
                    f"{t_meg * 1e3:.0f} ms ({size / t_meg / 1e9:.2f} GB/s)" if t_meg else "-",
                    f"{t_meg / t_digest:.1f}x" if t_meg else "-",
                    f"{peak / 1e6:.0f} MB" if peak is not None else "n/a",
                    "yes" if same else "NO",
                ]
            )
            print("  " + " | ".join(rows[-1]), flush=True)
            del tensors
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    print()
    print(
        table(
            [
                "dtype",
                "model",
                "copy (HBM)",
                "device digest",
                "digest rate / copy rate",
                "compiled digest (WEIGHTSYNC_AUDIT_COMPILE=1)",
                "megatron",
                "megatron / digest",
                "digest peak extra",
                "GPU == CPU digests",
            ],
            rows,
        )
    )
    print(f"\nstep: {D._DEVICE_WORDS_ACCEL} words ({16 * D._DEVICE_WORDS_ACCEL / 1e6:.0f} MB of scratch)")


if __name__ == "__main__":
    main()
