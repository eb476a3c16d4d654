"""The accelerator path in one run: right answers first, then rates. Prints one table; exits 1 on any wrong answer.

    python benchmarks/gpu_check.py              # on a machine with a CUDA GPU (1 and 4 GB models; a few minutes)
    python benchmarks/gpu_check.py --dry-run    # every check at small sizes on the CPU (what the test suite runs)

Without a CUDA device it dry-runs by itself. Checks (``answer`` column: ``ok``, ``WRONG`` or ``skipped``):

- ``digest == reference``: on-device digests equal the CPU reference for every dtype and layout and for
  several batch compositions (batched, streamed, mixed with large tensors, many batches, sampled), and
  the device passes its first-use probe;
- ``bit flips``: flipping any one of a sample of bits changes the digest, undoing it restores it;
- ``rate N GB``: the digest (``method="auto"``: on the device) against a device-to-device copy of the
  same bytes and against Megatron-LM's check (``benchmarks/baselines.py``) in the same run, with the
  digest's peak extra device memory;
- ``side-stream write``: a write queued on another stream is seen by the next digest (the device is
  synchronized first);
- ``resync fused|capturable Adam``: 2 ranks sharing the device; the fresh rank gets the source's state,
  ``step`` where torch keeps it, trains on, and audits in sync;
- ``xxh3 host memory``: ``method="xxh3"`` on device tensors holds a few ``CHUNK`` buffers of host memory,
  whatever the model size, and gives the host copy's digests;
- ``SyncBatchNorm``: DDP training with SyncBatchNorm on 2 ranks audits in sync (no false alarm on the
  running statistics). The dry run uses BatchNorm with broadcast buffers (SyncBatchNorm needs a GPU).
- ``overlap 2 ranks``, ``overlap step ratio``: the overlapped audit (``overlap=True``) on a side stream
  ordered after the step by an event: a planted drift found at the step it covers, and the step time
  with no audit, the synchronous and the overlapped every-step audit, with the overlapped digest's rate
  against a device-to-device copy (``benchmarks/gpu_overlap.py``);
- ``attribution: ...``, ``resume: ...``, ``Megatron hash check``: the ``run()`` of
  ``benchmarks/gpu_attribution.py`` (issue 31's faults on 2 ranks sharing the device, each named with its
  rank and class, and attribution's cost per step), ``gpu_resume.py`` (issue 32's per-rank resume with
  the CUDA generator) and ``gpu_megatron.py``, in that order (``skipped`` rows for a module absent).
  They run before this process touches CUDA, so a ``run()`` may fork ranks; Megatron's, last, opens a
  process group and CUDA here.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() must not initialise CUDA before fork

import argparse
import importlib
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_overlap
import harness  # noqa: F401 - first: it puts this checkout and tests/ on sys.path
import torch
import torch.distributed as dist
from baselines import megatron_check
from dtypes import ALL_DTYPES
from harness import launch, machine, peak_extra_bytes, table
from torch import nn

from weightsync_audit import audit, compat, resync
from weightsync_audit.engine.hashing import device_digest as D
from weightsync_audit.engine.hashing.digest import digest_tensors, workers
from weightsync_audit.engine.hashing.reader import CHUNK, host_bytes

_M64 = (1 << 64) - 1


def reference(data: bytes) -> int:
    """The device digest by its written definition, in pure Python (slow: small tensors only)."""

    def mix(x: int) -> int:
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & _M64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & _M64
        return x ^ (x >> 31)

    padded = data + bytes(-len(data) % 8)
    acc = 0
    for k in range(len(padded) // 8):
        acc = (acc + mix((int.from_bytes(padded[8 * k : 8 * k + 8], "little") + k * 0x9E3779B97F4A7C15) & _M64)) & _M64
    d = mix(acc ^ mix(len(data)))
    return d - (1 << 64) if d >= 1 << 63 else d


class Report:
    """The table's rows, and whether any answer was wrong."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []
        self.wrong = False

    def add(self, check: str, size: str, ok: bool | None, figures: str) -> None:
        self.wrong |= ok is False
        self.rows.append([check, size, "skipped" if ok is None else "ok" if ok else "WRONG", figures])
        print("  " + " | ".join(self.rows[-1]), flush=True)

    def run(self, check: str, size: str, fn: Callable[[], tuple[bool | None, str]]) -> None:
        try:
            ok, figures = fn()
        except Exception as exc:  # noqa: BLE001 - a crash is a wrong answer, reported in the table
            ok, figures = False, f"raised {type(exc).__name__}: {str(exc)[:160]}"
        self.add(check, size, ok, figures)


def sync(device: torch.device) -> None:
    compat.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int, warm: bool = True) -> float:
    if warm:
        fn()
        sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# -- right answers -----------------------------------------------------------------------------


def _layouts(dtype: torch.dtype, device: torch.device, seed: int) -> list[tuple[str, torch.Tensor]]:
    esize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (24 * 40 * esize + esize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    base = raw[esize:].view(dtype).to(device)  # a whole-element offset from a fresh host buffer
    grid = base.reshape(24, 40)
    out = [
        ("contiguous", grid),
        ("transposed", grid.t()),
        ("strided", grid[:, ::3]),
        ("offset", base[1:]),  # storage offset of one element: not word-aligned for small dtypes
        ("0-dim", base[5]),
        ("empty", base[:0].reshape(0, 4)),
        ("channels_last", base[: 2 * 4 * 3 * 5].reshape(2, 4, 3, 5).contiguous(memory_format=torch.channels_last)),
    ]
    if dtype.is_complex:
        out.append(("conj", grid.conj()))
    return out


def check_digests(device: torch.device) -> tuple[bool, str]:
    named = [
        (f"{str(dt).removeprefix('torch.')}/{lay}", t)
        for k, dt in enumerate(ALL_DTYPES)
        for lay, t in _layouts(dt, device, k)
    ]
    tensors = [t for _, t in named]
    expected = [reference(host_bytes(t)) for t in tensors]
    big = torch.randn(800_001, generator=torch.Generator().manual_seed(9)).to(device)[1:]  # 3.2 MB, misaligned
    big_ref = D.device_digests([big.cpu()])[0]  # the CPU run of the same code (tested against `reference`)
    compositions: dict[str, Callable[[], list[int]]] = {
        "batched": lambda: D.device_digests(tensors),
        "mixed with a large tensor": lambda: D.device_digests([*tensors, big])[:-1],
    }
    wrong = []
    for name, fn in compositions.items():
        if fn() != expected:
            wrong.append(name)
    with mock.patch.object(D, "_DEVICE_BATCH_BYTES", -1):
        if D.device_digests(tensors) != expected:
            wrong.append("streamed one by one")
    with mock.patch.object(D, "_DEVICE_BATCH_LIMIT", 256), mock.patch.object(D, "_DEVICE_PAD_LIMIT", 64):
        if D.device_digests(tensors) != expected:
            wrong.append("many small batches")
    with mock.patch.object(D, "_DEVICE_WORDS_ACCEL", 4096), mock.patch.object(D, "_DEVICE_WORDS", 4096):
        if D.device_digests([big]) != [big_ref]:
            wrong.append("small steps")
    if D.device_digests([big, *tensors[:3]])[0] != big_ref:
        wrong.append("large tensor")
    sampled = [D.device_digests([big], slice_index=i, slices=4)[0] for i in range(4)]
    if sampled != [D.device_digests([big.cpu()], slice_index=i, slices=4)[0] for i in range(4)]:
        wrong.append("sampled slices")
    probe = D.device_ok(device)
    if not probe:
        wrong.append("first-use probe failed (the host fallback is in use)")
    n = len(tensors) + 1
    return not wrong, f"{n} tensors, {len(ALL_DTYPES)} dtypes, 7 compositions, probe passed: {probe}" + (
        f"; WRONG: {', '.join(wrong)}" if wrong else ""
    )


def check_bit_flips(device: torch.device, nbytes: int, flips: int) -> tuple[bool, str]:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(device)
    small = [data[i * 100 : i * 100 + 13] for i in range(20)]  # batched path
    base, base_small = D.device_digests([data])[0], D.device_digests(small)
    rng = random.Random(2)
    missed = 0
    for k in range(flips):
        pos, bit = rng.randrange(nbytes if k % 2 else 2000), rng.randrange(8)
        data[pos] ^= 1 << bit
        changed = D.device_digests([data])[0] != base and (
            pos % 100 >= 13 or pos >= 2000 or D.device_digests(small) != base_small
        )
        data[pos] ^= 1 << bit
        missed += not changed
    restored = D.device_digests([data])[0] == base and D.device_digests(small) == base_small
    return missed == 0 and restored, f"{flips} single-bit flips, {missed} missed; restored: {restored}"


def check_side_stream(device: torch.device) -> tuple[bool, str]:
    w = torch.zeros(1 << 20, device=device)
    after = D.device_digests([torch.ones(1 << 20)])[0]
    calls: list[torch.device] = []
    real = compat.synchronize

    def counted(d: torch.device) -> None:
        calls.append(d)
        real(d)

    if device.type != "cuda":
        w.fill_(1.0)
        with mock.patch.object(compat, "synchronize", counted):
            got = digest_tensors([w], method="device")[0]
        return got == after and calls == [device], f"dry run (no streams): synchronize called {len(calls)}x"
    side = torch.cuda.Stream()
    busy = torch.randn(2048, 2048, device=device)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(50):  # work queued ahead of the write, so the write lands late
            busy = busy @ busy / 2048
        w.fill_(1.0)
    with mock.patch.object(compat, "synchronize", counted):
        got = digest_tensors([w], method="auto")[0]
    # The same race without the synchronization, for the record (timing-dependent, not an answer).
    w.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(50):
            busy = busy @ busy / 2048
        w.fill_(1.0)
    with mock.patch.object(compat, "synchronize", lambda d: None):
        unsynced = digest_tensors([w], method="auto")[0]
    torch.cuda.synchronize()
    return got == after, (
        f"write seen: {got == after}; synchronize called {len(calls)}x; "
        f"without it the digest read {'the finished write' if unsynced == after else 'a stale value'}"
    )


def check_xxh3_memory(device: torch.device, total: int) -> tuple[bool, str]:
    n = 8
    per = total // n // 4
    if device.type == "cpu":  # a stand-in whose host copies are real copies (CPU tensors are read in place)
        from fakedevice import fake

        tensors = [fake(torch.randn(per)) for _ in range(n)]
    else:
        tensors = [torch.randn(per, device=device) for _ in range(n)]
    digest_tensors([tensors[0][: CHUNK // 4]], method="xxh3")  # warm: the pool, lazy imports, staging buffers
    t0 = time.perf_counter()
    extra = peak_extra_bytes(lambda: digest_tensors(tensors, method="xxh3"))
    seconds = time.perf_counter() - t0
    right = digest_tensors(tensors[:1], method="xxh3")[0] == digest_tensors([tensors[0].cpu()], method="xxh3")[0]
    bound = (workers() + 2) * CHUNK
    if extra is None:
        return right, "peak host memory not measurable here"
    return right and extra < bound, (
        f"peak extra host memory {extra / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB, {workers()} threads) "
        f"for {n * per * 4 / 2**30:.2f} GiB; {n * per * 4 / seconds / 1e9:.3g} GB/s; digest == host copy's: {right}"
    )


# -- rates -------------------------------------------------------------------------------------


def _model(total: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """GPT-shaped blocks (d x 3d, d x d, d x 4d, 4d x d and vectors) up to ``total`` bytes, as parameters."""
    esize = torch.empty((), dtype=dtype).element_size()
    d = 4096
    while d > 64 and 12 * d * d * esize > total:
        d //= 2
    shapes = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    block = sum(esize * a * (b[0] if b else 1) for a, *b in shapes)
    model = nn.Module()
    g = torch.Generator(device=device).manual_seed(0)
    for i in range(max(1, total // block)):
        for j, shape in enumerate(shapes):
            t = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1, generator=g)
            model.register_parameter(f"p{i}_{j}", nn.Parameter(t, requires_grad=False))
    return model


def check_rate(device: torch.device, total: int, reps: int) -> tuple[bool, str]:
    model = _model(total, torch.bfloat16, device)
    tensors = [p.data for p in model.parameters()]
    size = sum(t.nbytes for t in tensors)
    twins = [torch.empty_like(t) for t in tensors]

    def copy() -> None:
        for a, b in zip(twins, tensors):
            a.copy_(b)

    t_copy = timed(copy, device, reps)
    twins.clear()
    method = "auto" if device.type != "cpu" else "device"
    first = digest_tensors(tensors, method=method)
    peak = "n/a"
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t_digest = timed(lambda: digest_tensors(tensors, method=method), device, reps)
    if device.type == "cuda":
        peak = f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.0f} MiB"
    same = (digest_tensors(tensors, method=method) == first).all()
    t_meg = timed(lambda: megatron_check(model), device, 1, warm=False)
    return bool(same), (
        f"{len(tensors)} tensors; d2d copy {size / t_copy / 1e9:.3g} GB/s; digest {t_digest * 1e3:.1f} ms "
        f"({size / t_digest / 1e9:.3g} GB/s, {100 * t_copy / t_digest:.0f}% of copy rate); Megatron "
        f"{t_meg * 1e3:.0f} ms ({t_meg / t_digest:.1f}x the digest); digest peak extra device memory {peak}"
    )


# -- two ranks sharing the device ----------------------------------------------------------------


def _resync_rank(rank: int, world: int, device: str, flag: str) -> dict[str, Any]:
    dev = torch.device(device)
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **{flag: True})

    def train(seed: int) -> None:
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed)).to(dev)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    if rank == 0:  # only the source has optimizer state
        train(1)
        train(2)
    resync(model, opt, src=0, timeout_s=60)
    placed = all(st["step"].device == p.device for p, st in opt.state.items())
    train(3)  # the same batch on both ranks: identical state must give identical weights
    result = audit(model, opt, timeout_s=60)
    return {"placed": placed, "in_sync": result.in_sync, "diverged": result.diverged_names[:4]}


def check_resync(device: torch.device, flag: str) -> tuple[bool | None, str]:
    if flag == "capturable" and device.type == "cpu":
        return None, "capturable Adam needs an accelerator (torch refuses it on the CPU)"
    got = launch(_resync_rank, 2, str(device), flag, timeout=240)
    ok = all(r["placed"] and r["in_sync"] for r in got)
    return (
        ok,
        f"step on the parameter's device: {[r['placed'] for r in got]}; in sync after a step: {[r['in_sync'] for r in got]} {got[0]['diverged'] or ''}",
    )


def _batchnorm_rank(rank: int, world: int, device: str) -> dict[str, Any]:
    dev = torch.device(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    sync_bn = dev.type != "cpu"
    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(dev)
    # SyncBatchNorm synchronizes the statistics itself: the buffers are not broadcast (the stand-in's are).
    kw: dict[str, Any] = {"broadcast_buffers": False} if sync_bn else {}
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index or 0] if dev.type == "cuda" else None, **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(5):  # different data on every rank
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(100 * rank + step)).to(dev)
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    result = audit(ddp, opt, timeout_s=60)
    dist.barrier()
    return {"in_sync": result.in_sync, "diverged": result.diverged_names[:4], "sync_bn": sync_bn}


def check_batchnorm(device: torch.device) -> tuple[bool, str]:
    got = launch(_batchnorm_rank, 2, str(device), timeout=240)
    what = "SyncBatchNorm" if got[0]["sync_bn"] else "dry run: BatchNorm with broadcast buffers"
    return all(r["in_sync"] for r in got), f"{what}; in sync: {[r['in_sync'] for r in got]} {got[0]['diverged'] or ''}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every check at small sizes on the CPU")
    p.add_argument("--sizes-gb", default="1,4", help="model sizes of the rate check (GB)")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda", None if dry else 0)
    sizes = [8 << 20, 32 << 20] if dry else [int(float(x) * 1e9) for x in args.sizes_gb.split(",")]
    print(f"# {machine()}; torch {torch.__version__}; device: {'CPU (dry run)' if dry else 'cuda:0'}", flush=True)
    if dry:  # Adam's and DDP's constructors import torch._dynamo (seconds): once here, every forked rank inherits it
        importlib.import_module("torch._dynamo")  # on a GPU, left to the ranks: nothing may touch CUDA before the forks
    report = Report()
    t0 = time.perf_counter()
    # The multi-rank checks fork: they come before this process initialises CUDA.
    for flag in ("fused", "capturable"):
        report.run(f"resync {flag} Adam", "2 ranks, 1 device", lambda flag=flag: check_resync(device, flag))
    report.run("SyncBatchNorm", "2 ranks, 1 device", lambda: check_batchnorm(device))
    report.run("overlap 2 ranks", "2 ranks, 1 device", lambda: gpu_overlap.check_ranks(device))
    for row in gpu_overlap.optional_checks(device, dry):  # other work's checks, when their modules are here
        report.add(*row)
    report.run("digest == reference", "every dtype/layout", lambda: check_digests(device))
    flips = 64 if dry else 512
    report.run("bit flips", f"{flips} flips", lambda: check_bit_flips(device, 1 << 16 if dry else 4 << 20, flips))
    report.run("side-stream write", "4 MiB", lambda: check_side_stream(device))
    xxh3_total = 64 << 20 if dry else 1 << 30
    report.run("xxh3 host memory", f"{xxh3_total / 2**20:.0f} MiB", lambda: check_xxh3_memory(device, xxh3_total))
    for total in sizes:
        label = f"{total / 1e9:.3g} GB bf16"
        report.run(f"rate {label}", label, lambda total=total: check_rate(device, total, args.reps))
    size = "MLP 256x3" if dry else "MLP 8192x6, 4.8 GB"
    report.run("overlap step ratio", size, lambda: gpu_overlap.check_step_ratio(device, dry))
    print()
    print(table(["check", "size", "answer", "figures"], report.rows))
    print(f"\n{time.perf_counter() - t0:.0f} s; {'a WRONG answer above' if report.wrong else 'every answer right'}")
    return 1 if report.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
