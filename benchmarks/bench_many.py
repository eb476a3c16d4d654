"""Cost per audited entry for models of many small tensors, with and without Adam's state.

    python benchmarks/bench_many.py                       # 1,000 / 20,000 / 100,000 entries, one process
    python benchmarks/bench_many.py --entries 20000 --worlds 1,2

Each model is a stack of ``Linear(16, 16)`` (a 1 KiB weight and a 64-byte bias). "+ Adam" means one
Adam step has run, so every parameter also has ``exp_avg``, ``exp_avg_sq`` and ``step`` and the param
group's hyper-parameters are audited: 4 entries per parameter plus the group's. The number of layers is
chosen so that the audited entries come to about the asked-for count (20,011 for 2,500 layers + Adam).

In the same run, on the same ranks, between barriers (the slowest rank counts, median of the repetitions):

- ``audit``: ``Auditor(model, opt).audit()`` on a warmed-up auditor (the steady state of a training run);
- ``seed``: the seed's sha256 check (``benchmarks/baselines.py``) over the parameters alone, timed in
  turns with ``audit`` within each repetition (the order alternating), wall time and the CPU time of
  the calling thread (``time.thread_time``); the ratios are medians of the per-repetition ratios, so
  the load of the moment (this machine is shared) weighs on both sides alike;
- ``first audit``: a new ``Auditor`` per call (what one ``audit()`` call, or any structure change, costs).

``--floor``: the three per-tensor passes an audit of small tensors needs (layout, address, xxh3), each alone,
in turns with the seed's check and the audit in one process: what any audit that checks what it reads in
Python costs at least.

The floor of issue 16: with 20,011 entries (2,500 layers + Adam), ``audit`` no slower than ``seed``
over the 5,000 parameters, and under 1.5 us per entry from 20,000 entries on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from baselines import seed_check
from harness import launch, machine, median, own_copy, table, timed
from torch import nn

from weightsync_audit import Auditor
from weightsync_audit.compat import layout_guard
from weightsync_audit.engine.hashing.digest_plan import CHUNK
from weightsync_audit.engine.hashing.reader import in_place

_CASE: tuple[nn.Module, torch.optim.Optimizer | None] | None = None  # built in the parent, inherited by ranks


def build(entries: int, adam: bool) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Layers of ``Linear(16, 16)`` making about ``entries`` audited entries; with one Adam step if asked."""
    layers = max(1, entries // (8 if adam else 2))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(layers)))
    if not adam:
        return model, None
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def _rank(rank: int, world: int, reps: int) -> dict[str, Any]:
    assert _CASE is not None
    model, opt = _CASE
    if world > 1:
        own_copy(model)  # each rank reads its own memory (the optimizer state stays shared copy-on-write)
    auditor = Auditor(model, opt)
    result = auditor.audit()
    assert result.in_sync
    entries = sum(result.checked.values())
    out: dict[str, Any] = {"entries": entries, "params": len(list(model.parameters()))}
    wall, cpu = paired({"audit": auditor.audit, "seed": lambda: seed_check(model)}, reps)
    out["audit"], out["seed"] = median(wall["audit"]), median(wall["seed"])
    out["ratio"] = median([s / a for s, a in zip(wall["seed"], wall["audit"])])
    out["audit_cpu"], out["seed_cpu"] = median(cpu["audit"]), median(cpu["seed"])
    out["ratio_cpu"] = median([s / a for s, a in zip(cpu["seed"], cpu["audit"])])
    out["first"] = median(timed(lambda: Auditor(model, opt).audit(), max(3, reps // 2)))
    return out


def paired(fns: dict[str, Any], reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall seconds (slowest rank) and this thread's CPU seconds (slowest rank) per call of each of ``fns``,
    taken in turns within each repetition (the order alternating), so that the load of the moment weighs
    on all of them alike; each ratio is then taken repetition by repetition.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(reps):
        for name in names if i % 2 == 0 else names[::-1]:
            if world > 1:
                dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            fns[name]()
            cpu[name].append(time.thread_time() - c0)
            wall[name].append(time.perf_counter() - t0)
    if world > 1:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (wall, cpu))
        wall = {k: [max(w[k][i] for w, _ in everyone) for i in range(reps)] for k in fns}
        cpu = {k: [max(c[k][i] for _, c in everyone) for i in range(reps)] for k in fns}
    return wall, cpu


def floor(entries: int, reps: int) -> str:
    """What the three C-level passes every audit of small tensors needs cost alone, over the audited tensors
    (parameters and Adam's moments and steps), in one process, in turns with the seed's check and the audit:
    the layout check (the C++ guard, in the audit's chunks), the addresses (``Tensor.data_ptr``) and xxh3 over
    the memory of each, and the three chunk by chunk as the audit runs them. Each pass is one call per tensor
    into torch or xxhash; the three together are the floor of any audit that checks what it reads in Python,
    whatever it does around them."""
    model, opt = build(entries, True)
    assert opt is not None
    auditor = Auditor(model, opt)
    assert auditor.audit().in_sync
    tensors = [*model.parameters()]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    cut = [tensors[i : i + CHUNK] for i in range(0, len(tensors), CHUNK)]
    guards = [layout_guard(part) for part in cut]
    views = [in_place(t) for t in tensors]
    xxh, ptr = xxhash.xxh3_64_intdigest, torch.Tensor.data_ptr
    chunks = [(g, part, views[i * CHUNK : (i + 1) * CHUNK]) for i, (g, part) in enumerate(zip(guards, cut))]

    def together() -> None:  # chunk by chunk, as the audit runs them: a chunk's metadata is still in cache
        for g, part, vs in chunks:
            _ = g is None or g(part), list(map(ptr, part)), np.fromiter(map(xxh, vs), np.uint64, len(vs))

    fns: dict[str, Any] = {
        "seed": lambda: seed_check(model),
        "audit": auditor.audit,
        "layout": lambda: [g(part) for g, part in zip(guards, cut) if g is not None],
        "address": lambda: list(map(ptr, tensors)),
        "xxh3": lambda: np.fromiter(map(xxh, views), np.uint64, len(views)),
        "the three, chunk by chunk": together,
    }
    wall, _ = paired(fns, reps)
    ms = {k: median(v) * 1e3 for k, v in wall.items()}
    rows = [[k, f"{v:.2f}", f"{v / ms['seed']:.2f}x"] for k, v in ms.items()]
    head = f"{len(tensors):,} tensors ({entries:,} entries asked), medians of {reps} turns, one process:"
    return head + "\n" + table(["pass", "ms", "of the seed's check"], rows)


def main(argv: list[str] | None = None) -> None:
    global _CASE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", default="1000,20000,100000")
    p.add_argument("--optimizer", default="none,adam", help="comma-separated: none, adam")
    p.add_argument("--worlds", default="1")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", type=Path, help="write the raw figures here")
    p.add_argument("--floor", action="store_true", help="the per-tensor passes alone, against the seed's check")
    args = p.parse_args(argv)
    print(f"# {machine()}", flush=True)
    if args.floor:
        for n in [int(x) for x in args.entries.split(",")]:
            print(floor(n, args.reps))
        return
    rows = []
    for n in [int(x) for x in args.entries.split(",")]:
        for opt_name in args.optimizer.split(","):
            t0 = time.perf_counter()
            _CASE = build(n, opt_name == "adam")
            built = time.perf_counter() - t0
            for world in [int(w) for w in args.worlds.split(",")]:
                r = launch(_rank, world, args.reps)[0] if world > 1 else _rank(0, 1, args.reps)
                r.update(world=world, optimizer=opt_name, built_s=built)
                rows.append(r)
                print(
                    f"  {r['entries']} entries ({opt_name}), {world} rank(s): audit {r['audit'] * 1e3:.2f} ms, "
                    f"first audit {r['first'] * 1e3:.1f} ms, seed {r['seed'] * 1e3:.2f} ms",
                    flush=True,
                )
            _CASE = None
    headers = ["entries", "state", "ranks", "params", "audit ms", "per entry", "first audit ms", "per entry (first)"]
    headers += ["seed ms (params only)", "seed/audit (wall)", "CPU ms: audit / seed", "seed/audit (CPU)"]
    body = [
        [
            f"{r['entries']:,}",
            "Adam" if r["optimizer"] == "adam" else "none",
            str(r["world"]),
            f"{r['params']:,}",
            f"{r['audit'] * 1e3:.2f}",
            f"{r['audit'] / r['entries'] * 1e6:.2f} us",
            f"{r['first'] * 1e3:.1f}",
            f"{r['first'] / r['entries'] * 1e6:.2f} us",
            f"{r['seed'] * 1e3:.2f}",
            f"{r['ratio']:.2f}x",
            f"{r['audit_cpu'] * 1e3:.2f} / {r['seed_cpu'] * 1e3:.2f}",
            f"{r['ratio_cpu']:.2f}x",
        ]
        for r in rows
    ]
    print()
    print(table(headers, body))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
