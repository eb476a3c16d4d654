"""Cost of a full and of a sampled weight audit, against the checks in use today and the memory-copy limit.

    python benchmarks/bench_audit.py                      # everything (about 5 minutes on 2 cores)
    python benchmarks/bench_audit.py --models 100M --worlds 2 --reps 9
    python benchmarks/bench_audit.py --adam                # small models with Adam: the fixed cost (1 minute)

For each model and number of gloo ranks (forked on this machine, each rank owning its copy of the
model), every method runs on all ranks at once, between barriers; a repetition lasts until the slowest
rank is done, and the median repetition is printed:

- ``audit``: ``Auditor(model).audit()``, the whole path (manifest, digests, the summary exchange);
- ``1/8``: the same auditor with ``coverage="1/8"`` (24 repetitions: each slice three times);
- ``seed``: sha256 + ``all_gather_object`` (the Lightning #20340 report's check);
- ``megatron``: per-parameter sha1 of a CPU float copy + a tensor all-gather (Megatron-LM);
- ``memcpy``: a copy of the same bytes into a preallocated twin, on the same threads as the digest.

``--adam``: instead, the healthy audit of the parameters *and* Adam's state on 2 ranks against the seed's
and Megatron's checks of the parameters alone, on the seed's model (``Linear(32, 16)``, ``Linear(16, 2)``:
4 tensors), a 29-tensor toy, 1M and 10M parameters; the three methods taken in turns within each of
``--reps`` x ``--rounds`` repetitions (the order alternating), the median repetition of each and the median
of the ratios taken repetition by repetition (the load of the moment weighs on all three alike); also rank 0's CPU time
per call on the calling thread (the fixed cost without the waits, steadier than wall time on a busy host),
and the CPU time per call of each check in the parent process, without a process group (no message at all).
In the same turns, a ping-pong of one 184-byte message each way on the same ranks: half of it is one hop
(a loopback write and the receiver's wake-up), printed beside the audit's time less Megatron's, repetition
by repetition: the star's answer is one hop more than an all-gather's single exchange.

Also printed: the peak resident memory each method adds (``VmHWM``, max over ranks) and the bytes the
audit puts on the wire per rank on the healthy path. ``--json`` writes the raw figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from baselines import MemoryCopy, megatron_check, plain_xxh3_check, seed_check
from bench_many import paired
from harness import launch, machine, median, own_copy, peak_extra_bytes, table, timed
from models import SPECS, ModelSpec, build, count, nbytes

from weightsync_audit import Auditor
from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.hashing.digest import workers

_MODEL: torch.nn.Module | None = None  # built in the parent, inherited by the forked ranks


def wire_bytes(fn: Callable[[], Any]) -> dict[str, int]:
    """Point-to-point messages and bytes this rank sends and receives over the audit channel while ``fn`` runs."""
    counts = {"sent_msgs": 0, "sent": 0, "recv_msgs": 0, "recv": 0}
    original = Comm.post

    def counted(self: Comm, pg: Any, t: torch.Tensor, peer: int, send: bool) -> Any:
        side = "sent" if send else "recv"
        counts[side + "_msgs"] += 1
        counts[side] += t.numel() * t.element_size()
        return original(self, pg, t, peer, send)

    Comm.post = counted  # type: ignore[method-assign]
    try:
        fn()
    finally:
        Comm.post = original  # type: ignore[method-assign]
    return counts


def _rank(rank: int, world: int, reps: int, methods: list[str]) -> dict[str, Any]:
    assert _MODEL is not None
    model = own_copy(_MODEL)
    full = Auditor(model)
    sampled = Auditor(model, coverage="1/8")
    full.setup()
    sampled.setup()

    def audit_full() -> None:
        assert full.audit().in_sync

    def audit_sampled() -> None:
        assert sampled.audit().in_sync

    fns: dict[str, Callable[[], Any]] = {
        "audit": audit_full,
        "1/8": audit_sampled,
        "seed": lambda: seed_check(model),
        "megatron": lambda: megatron_check(model),
        "xxh3": lambda: plain_xxh3_check(model),
    }
    out: dict[str, Any] = {"threads": workers()}
    for name in methods:
        if name == "memcpy":
            fn: Callable[[], Any] = MemoryCopy(model, workers())
        else:
            fn = fns[name]
        try:
            fn()  # warm-up, and the check that it runs at all (the seed's check fails on bf16)
        except TypeError as exc:
            out[name] = None
            out[name + "_why"] = str(exc)
            continue
        n = 24 if name == "1/8" else (max(3, reps // 2) if name in ("seed", "megatron", "xxh3") else reps)
        out[name] = median(timed(fn, n, warmup=0))
        out[name + "_mem"] = peak_extra_bytes(fn)
        del fn
    out["wire"] = wire_bytes(audit_full)
    return out


def _adam_model(key: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    if key == "seed4":
        model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 2))
    elif key == "toy29":  # an embedding and 14 linear layers: 29 tensors
        model = torch.nn.Sequential(torch.nn.Embedding(64, 32), *(torch.nn.Linear(32, 32) for _ in range(14)))
    else:
        model = build(SPECS.get(key) or ModelSpec("1M fp32", "gpt", d=64, layers=10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # Adam's state exists, alike on every rank
    return model, opt


def _rank_adam(rank: int, world: int, key: str, reps: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, opt = _adam_model(key)
    auditor = Auditor(model, opt)
    auditor.setup()
    fns: dict[str, Callable[[], Any]] = {
        "audit": lambda: auditor.audit(),
        "seed": lambda: seed_check(model),
        "megatron": lambda: megatron_check(model),
        "ping": pinger(rank),
    }
    assert auditor.audit().in_sync
    # In turns within each repetition (the order alternating), each ratio taken repetition by repetition:
    # the load of the moment weighs on the three alike (this host is shared).
    wall, _ = paired(fns, reps * rounds)
    out: dict[str, Any] = {k: median(v) for k, v in wall.items()}
    for base in ("seed", "megatron"):
        out["audit/" + base] = median([a / b for a, b in zip(wall["audit"], wall[base])])
    out["audit-megatron"] = median([a - b for a, b in zip(wall["audit"], wall["megatron"])])
    for name, fn in fns.items():  # this thread's CPU time per call: the fixed cost without the waits
        dist.barrier()
        t0 = time.thread_time()
        for _ in range(reps):
            fn()
        out[name + "_cpu"] = (time.thread_time() - t0) / reps
    out["tensors"] = len(list(model.parameters()))
    out["params"] = count(model)
    return out


def pinger(rank: int) -> Callable[[], None]:
    """One message of a healthy audit's size (a 184-byte frame) to the other rank and one back, on the default
    gloo group: two hops, each a loopback write and the receiver's wake-up. The audit's answer is one hop more
    than an all-gather's exchange (the summaries up, then the coordinator's answer down)."""
    t, r = torch.zeros(23, dtype=torch.int64), torch.zeros(23, dtype=torch.int64)

    def ping() -> None:
        if rank == 0:
            dist.send(t, 1)
            dist.recv(r, 1)
        else:
            dist.recv(r, 0)
            dist.send(t, 0)

    return ping


def one_rank_cpu(key: str, calls: int = 2000) -> dict[str, float]:
    """CPU seconds per call of each check in this process, no process group (a world of one): the fixed cost
    without any message, the steadiest figure on a shared host (the second best of 7 blocks of ``calls``)."""
    model, opt = _adam_model(key)
    auditor = Auditor(model, opt)
    fns = {"audit": auditor.audit, "seed": lambda: seed_check(model), "megatron": lambda: megatron_check(model)}
    out = {}
    for name, fn in fns.items():
        for _ in range(calls // 10):
            fn()
        blocks = []
        for _ in range(7):
            t0 = time.thread_time()
            for _ in range(calls):
                fn()
            blocks.append((time.thread_time() - t0) / calls)
        out[name] = sorted(blocks)[1]
    return out


def run_adam(keys: list[str], reps: int, rounds: int) -> str:
    rows = []
    for key in keys:
        # Small models only: a large one's digests and copies run on other threads too.
        one = one_rank_cpu(key) if key in ("seed4", "toy29") else None
        r = launch(_rank_adam, 2, key, reps, rounds)[0]
        a, s, m = r["audit"], r["seed"], r["megatron"]
        rows.append([key, str(r["tensors"]), f"{r['params']:,}", *(f"{x * 1e3:.2f}" for x in (a, s, m))])
        rows[-1] += [
            f"{r['audit/seed']:.2f}x",
            f"{r['audit/megatron']:.2f}x",
            *(f"{r[k + '_cpu'] * 1e6:.0f}" for k in ("audit", "seed", "megatron")),
        ]
        rows[-1] += [f"{r['audit-megatron'] * 1e6:.0f}", f"{r['ping'] / 2 * 1e6:.0f}"]
        rows[-1] += [" / ".join(f"{one[k] * 1e6:.0f}" for k in ("audit", "seed", "megatron")) if one else "n/a"]
        rows[-1] += [f"{os.getloadavg()[0]:.2f}"]
        print("  " + " ".join(rows[-1]), flush=True)
    headers = ["model", "tensors", "params", "audit ms", "seed ms", "megatron ms", "audit/seed", "audit/megatron"]
    cpu = ["audit CPU us", "seed CPU us", "megatron CPU us", "audit - megatron us", "one hop us"]
    cpu += ["1 rank CPU us: audit / seed / megatron"]
    return table([*headers, *cpu, "load"], rows)


def run(keys: list[str], worlds: list[int], reps: int, methods: list[str]) -> list[dict[str, Any]]:
    global _MODEL
    rows = []
    for key in keys:
        spec = SPECS[key]
        t0 = time.perf_counter()
        _MODEL = build(spec)
        size, params, tensors = nbytes(_MODEL), count(_MODEL), len(list(_MODEL.parameters()))
        print(
            f"# {spec.label}: {params / 1e6:.1f}M parameters in {tensors} tensors, {size / 1e6:.0f} MB "
            f"(built in {time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
        for world in worlds:
            per_rank = launch(_rank, world, reps, methods)
            r0 = per_rank[0]
            row = {"model": spec.label, "key": key, "params": params, "tensors": tensors, "bytes": size, "world": world}
            row.update({k: v for k, v in r0.items() if k != "wire"})
            row["wire_rank0"] = r0["wire"]
            row["wire_rank1"] = per_rank[1]["wire"] if world > 1 else None
            rows.append(row)
            row["loadavg_after"] = os.getloadavg()[0]
            print("  " + summary_line(row) + f" (load average {row['loadavg_after']:.2f})", flush=True)
        _MODEL = None
    return rows


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f}" if x < 10 else f"{x * 1e3:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.1f}x"


def summary_line(row: dict[str, Any]) -> str:
    return (
        f"{row['world']} rank(s): audit {_ms(row.get('audit'))} ms, 1/8 {_ms(row.get('1/8'))} ms, "
        f"seed {_ms(row.get('seed'))} ms, megatron {_ms(row.get('megatron'))} ms, memcpy {_ms(row.get('memcpy'))} ms"
    )


def render(rows: list[dict[str, Any]]) -> str:
    headers = [
        "model",
        "ranks",
        "audit ms",
        "GB/s/rank",
        "memcpy GB/s/rank",
        "audit/memcpy",
        "seed ms",
        "seed/audit",
        "megatron ms",
        "megatron/audit",
        "xxh3 ms",
        "xxh3/audit",
        "1/8 ms",
        "full/(1/8)",
        "audit peak extra",
        "seed peak extra",
        "megatron peak extra",
        "per tensor",
    ]
    out = []
    for r in rows:
        a, m = r.get("audit"), r.get("memcpy")
        gbs = r["bytes"] / a / 1e9 if a else None
        mgbs = r["bytes"] / m / 1e9 if m else None

        def mem(name: str, r: dict[str, Any] = r) -> str:
            b = r.get(name + "_mem")
            if b is None:
                return "n/a"
            return f"{b / 1e6:.1f} MB ({100 * b / r['bytes']:.1f}%)"

        out.append(
            [
                r["model"],
                str(r["world"]),
                _ms(a),
                f"{gbs:.1f}" if gbs else "n/a",
                f"{mgbs:.1f}" if mgbs else "n/a",
                f"{100 * gbs / mgbs:.0f}%" if gbs and mgbs else "n/a",
                _ms(r.get("seed")),
                _ratio(r.get("seed"), a),
                _ms(r.get("megatron")),
                _ratio(r.get("megatron"), a),
                _ms(r.get("xxh3")),
                _ratio(r.get("xxh3"), a),
                _ms(r.get("1/8")),
                _ratio(a, r.get("1/8")),
                mem("audit"),
                mem("seed"),
                mem("megatron"),
                f"{a / r['tensors'] * 1e6:.2f} us" if a and r["key"] == "5000-small" else "",
            ]
        )
    return table(headers, out)


def render_wire(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        if r["world"] < 2:
            continue
        w0, w1 = r["wire_rank0"], r["wire_rank1"]
        out.append(
            [
                r["model"],
                str(r["world"]),
                f"{w1['sent_msgs']} / {w1['sent']} B",
                f"{w1['recv_msgs']} / {w1['recv']} B",
                f"{w0['sent_msgs']} / {w0['sent']} B",
                f"{w0['recv_msgs']} / {w0['recv']} B",
            ]
        )
    return table(["model", "ranks", "rank 1 sends", "rank 1 receives", "rank 0 sends", "rank 0 receives"], out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(SPECS), help=f"comma-separated, from {list(SPECS)}")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--methods", default="audit,1/8,seed,megatron,xxh3,memcpy")
    p.add_argument("--json", type=Path, help="write the raw figures here")
    p.add_argument("--adam", action="store_true", help="the small models with Adam's state (the fixed cost)")
    p.add_argument("--rounds", type=int, default=5, help="with --adam: rounds of --reps repetitions each")
    args = p.parse_args(argv)
    print(f"# {machine()}; digest threads per rank: {workers()}", flush=True)
    if args.adam:
        keys = args.models.split(",") if args.models != ",".join(SPECS) else ["seed4", "toy29", "1M", "10M"]
        print(run_adam(keys, args.reps, args.rounds))
        return
    rows = run(args.models.split(","), [int(w) for w in args.worlds.split(",")], args.reps, args.methods.split(","))
    print()
    print(render(rows))
    print()
    print("Healthy-path traffic of one audit (point-to-point messages / bytes):")
    print(render_wire(rows))
    for r in rows:
        if r.get("seed_why"):
            print(f"\nseed check on {r['model']}: fails with TypeError: {r['seed_why']}")
            break
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
