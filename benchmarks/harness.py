"""Shared plumbing for the benchmark scripts: forked gloo ranks, aligned timing, peak-memory probes.

Ranks are forked from the parent (like ``tests/ranks.py``) so that a model built once in the parent is
cheap to hand over; every rank then clones it, so that each one reads its own memory, as real replicas do.
Timings are taken between barriers and the slowest rank's time counts (an audit is collective: it is
over when the last rank is done); the median of several repetitions is reported.
"""

from __future__ import annotations

import ctypes
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/x.py` from a checkout
    sys.path.insert(0, str(ROOT))
if str(ROOT / "tests") not in sys.path:  # the forked-ranks launcher lives with the tests
    sys.path.insert(1, str(ROOT / "tests"))


def launch(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 1800) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks; return each rank's result.

    The tests' launcher (``tests/ranks.py``) with a long process-group timeout: a baseline's barrier
    may wait minutes for the slowest rank on a 400M model.
    """
    from ranks import run_ranks

    return run_ranks(fn, world, *args, timeout=timeout, pg_timeout_s=600)


def own_copy(module: torch.nn.Module) -> torch.nn.Module:
    """Give this rank its own copy of every tensor (after fork they are shared copy-on-write pages)."""
    with torch.no_grad():
        for p in module.parameters():
            p.data = p.data.clone()
        for name, b in list(module.named_buffers()):
            owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
            setattr(owner, name.rpartition(".")[2], b.clone())
    gc.collect()
    return module


def timed(fn: Callable[[], Any], reps: int, warmup: int = 1) -> list[float]:
    """Seconds per call of collective ``fn``, slowest rank per repetition, on every rank."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    for _ in range(warmup):
        fn()
    mine = []
    for _ in range(reps):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        mine.append(time.perf_counter() - t0)
    if world == 1:
        return mine
    everyone: list[list[float] | None] = [None] * world
    dist.all_gather_object(everyone, mine)
    return [max(ts[i] for ts in everyone if ts is not None) for i in range(reps)]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _trim() -> None:
    """Hand freed heap memory back to the OS, so that a re-allocation shows up in the peak again."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_extra_bytes(fn: Callable[[], Any]) -> int | None:
    """Peak resident memory ``fn`` adds to this process (Linux: resets and reads ``VmHWM``), max over ranks.

    Collective when a process group is up (every rank runs ``fn``). ``None`` where it cannot be measured.
    """
    gc.collect()
    _trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kb("VmRSS")
    except OSError:
        fn()
        return None
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    fn()
    extra = max(0, _status_kb("VmHWM") - before) * 1024
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([extra], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        extra = int(t)
    return extra


def machine() -> str:
    """One line about where the figures come from."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    import xxhash

    return (
        f"{cpu}, {cores} cores{mem}; torch {torch.__version__}, xxhash {xxhash.VERSION}, "
        f"Python {sys.version.split()[0]}"
    )


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table (printable as is, pasteable into the docs)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"]
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out.extend("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in rows)
    return "\n".join(out)
