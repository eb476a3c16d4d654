"""Cost of the audit channel as the number of ranks grows, against bare gloo collectives in the same run.

    python benchmarks/bench_channel.py                    # 2, 4, 8, 16 and 32 ranks (about 3 minutes on 2 cores)
    python benchmarks/bench_channel.py --worlds 2 4 --reps 20
    python benchmarks/bench_channel.py --fleet            # healthy path, 2..64 ranks, star and tree, fitted

For each number of gloo ranks (forked on this machine), between barriers, slowest rank per repetition,
median repetition:

- ``all_gather 64 B`` / ``all_reduce 64 B``: bare gloo collectives of one audit summary, on the job's group;
- ``round``: the channel's healthy round alone (every rank's 104-byte summary to the coordinator, a
  fixed-size verdict back: ``engine.agreement.agree``);
- ``audit``: ``Auditor(model).audit()`` in sync on a small model (two ``Linear(8, 8)``: 4 tensors), so that
  the channel, not the hashing of 2 cores shared by up to 32 ranks, is what is measured;
- ``diverged``: an audit of 1,000 tensors of 16 floats, one of them different on the last rank (digest
  columns compared by the coordinator, the gap measured);
- ``all_gather 8 KB``: bare gloo all_gather of one rank's per-tensor digests (the diverged case's bytes).

Bytes are counted by the channel itself (``Comm.sent_bytes``): what rank 0 and the other ranks send per
healthy audit, and the most bytes through any one rank (sent + received) per diverged audit. Also: rank 0's
CPU time per healthy audit, and the time to open the audit channel (once per process).

``--fleet``: the healthy path only, at 2, 4, 8, 16, 32 and 64 ranks: the audit's latency (slowest rank),
the coordinator's and another rank's CPU time per audit and bytes per audit, and a bare all_gather of the
same summary; each fitted by least squares to ``a + b * ranks`` and the fits' figures printed for 1,024 and
16,384 ranks next to the all-gather's (gloo's ring: ``ranks - 1`` steps, and as many summaries through
every rank). Then the same worlds as a tree (``--hosts-of 8`` ranks per "host",
:class:`weightsync_audit.channel.star.TreeWire`): the coordinator's and a leader's CPU time and peers (messages each
sends per audit: one per rank it answers, and a leader's one up), the coordinator's fitted per rank and per
peer, and the per-peer fit's figures for the layout a fleet of hosts of 8 gets at 1,024 and 16,384 ranks.
Ranks beyond the cores share them, so latencies are upper bounds; the coordinator's CPU time per peer is
the figure that says how far one coordinator goes.
"""

from __future__ import annotations

import argparse
import os
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


def _rank_fleet(rank: int, world: int, reps: int) -> dict[str, Any]:
    """The healthy path only: latency, CPU time, bytes and messages per audit, and a bare all_gather of 64 B."""
    torch.set_num_threads(1)
    auditor = Auditor(_small(), timeout_s=300)
    auditor.setup()
    comm = auditor.comm
    one = torch.zeros(8, dtype=torch.int64)
    gathered = [torch.zeros(8, dtype=torch.int64) for _ in range(world)]
    out: dict[str, Any] = {"all_gather": median(timed(lambda: dist.all_gather(gathered, one), reps))}
    assert auditor.audit().in_sync
    out["audit"] = median(timed(lambda: auditor.audit(), reps))
    sent, messages, cpu = comm.sent_bytes, comm._group.sent_messages, time.process_time()
    for _ in range(reps):
        auditor.audit()
    out["cpu"] = (time.process_time() - cpu) / reps
    out["sent"] = (comm.sent_bytes - sent) / reps
    out["peers"] = (comm._group.sent_messages - messages) / reps  # one answer per child, one request up
    out["block"] = comm._group.block
    return out


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``a + b * x``."""
    b, a = np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 1)
    return float(a), float(b)


def _roles(res: list[dict[str, Any]]) -> dict[str, Any]:
    """The coordinator's, the busiest leader's and the busiest other rank's figures (ms, bytes) in one run."""
    k = res[0]["block"] or len(res)
    leaders = [r for r in range(k, len(res), k)]
    others = [r for r in range(1, len(res)) if r not in leaders]
    reply = res[0]["sent"] / res[0]["peers"]  # the same answer frame to every child
    up = [res[r]["sent"] - (min(r + k, len(res)) - r - 1) * reply for r in leaders]  # a leader's frame up
    lead = max(leaders, key=lambda r: res[r]["cpu"]) if leaders else None
    return {
        "audit": res[0]["audit"] * 1e3,
        "all_gather": res[0]["all_gather"] * 1e3,
        "cpu0": res[0]["cpu"] * 1e3,
        "cpu1": max(res[r]["cpu"] for r in others) * 1e3,
        "recv0": sum(res[r]["sent"] for r in others if r < k) + sum(up),
        "sent1": max(res[r]["sent"] for r in others),
        "peers0": res[0]["peers"],
        "lead": (res[lead]["cpu"] * 1e3, res[lead]["peers"]) if lead else None,
    }


def fleet(worlds: list[int], reps: int, per_host: int) -> None:
    from weightsync_audit.channel.star import RANKS_PER_HOST_ENV, block_size

    rows, runs = [], []
    for layout in ("star", f"hosts of {per_host}"):
        for world in worlds if layout == "star" else [w for w in worlds if w > per_host]:
            os.environ[RANKS_PER_HOST_ENV] = "" if layout == "star" else str(per_host)
            v = _roles(launch(_rank_fleet, world, reps or max(5, 160 // world), timeout=900))
            runs.append((layout, world, v))
            lead = f"{v['lead'][0]:.2f} ({v['lead'][1]:.0f})" if v["lead"] else "-"
            rows.append([str(world), layout] + [f"{v[k]:.2f}" for k in ("audit", "all_gather", "cpu0")])
            rows[-1] += [f"{v['peers0']:.0f}", lead, f"{v['cpu1']:.2f}", f"{v['recv0']:.0f} B", f"{v['sent1']:.0f} B"]
            print(f"{world} ranks, {layout} done", flush=True)
    os.environ.pop(RANKS_PER_HOST_ENV, None)
    headers = ["ranks", "layout", "audit ms", "all_gather 64 B ms", "coordinator CPU ms", "coordinator peers"]
    print(table([*headers, "leader CPU ms (peers)", "other rank CPU ms", "coordinator receives", "other sends"], rows))

    star = [(w, v) for layout, w, v in runs if layout == "star"]
    tree = [(w, v) for layout, w, v in runs if layout != "star"]
    fits = {k: _fit([w for w, _ in star], [v[k] for _, v in star]) for k in star[0][1] if k not in ("peers0", "lead")}
    print("\nstar, fitted a + b * ranks: " + ", ".join(f"{k} {a:.3g} + {b:.3g} n" for k, (a, b) in fits.items()))
    out = []
    for n in (1024, 16384):
        f = {k: a + b * n for k, (a, b) in fits.items()}
        ring = 64 * (n - 1)  # gloo's ring all_gather: every summary passes through every rank
        row = [f"{n:,}", f"{f['audit']:.0f}", f"{f['all_gather']:.0f}", f"{f['cpu0']:.0f}", f"{f['cpu1']:.2f}"]
        out.append([*row, f"{f['recv0'] / 1e6:.2f} MB", f"{f['sent1']:.0f} B", f"{ring / 1e6:.2f} MB"])
    headers = ["ranks", "audit ms", "all_gather ms", "coordinator CPU ms", "other rank CPU ms"]
    print(table([*headers, "coordinator receives", "other rank sends", "all_gather through each rank"], out))
    print(
        f"\nstar: the coordinator's CPU share {fits['cpu0'][1] * 1000:.1f} ms per 1,000 ranks (the issue's bound: 10)"
    )
    if not tree:
        return
    c0, cl = (
        _fit([w for w, _ in tree], [v["cpu0"] for _, v in tree]),
        _fit([w for w, _ in tree], [v["lead"][0] for _, v in tree]),
    )
    print(
        f"hosts of {per_host}, fitted a + b * ranks: coordinator {c0[0]:.3g} + {c0[1]:.3g} n ({c0[1] * 1000:.1f} ms per 1,000 ranks), leader {cl[0]:.3g} + {cl[1]:.3g} n"
    )
    # The coordinator's CPU per audit against the peers it handles (children answered), star and tree runs.
    a, b = _fit([v["peers0"] for _, _, v in runs], [v["cpu0"] for _, _, v in runs])
    print(f"coordinator, fitted a + b * peers: {a:.3g} + {b:.4g} p ms (a leader of k ranks: about k peers)")
    out = []
    for n in (1024, 16384):
        k = block_size([f"host{r // per_host}" for r in range(n)])
        peers = k - 1 + -(-n // k) - 1
        cpu = a + b * peers
        out.append([f"{n:,}", f"{k}", f"{peers}", f"{cpu:.1f}", f"{cpu / n * 1000:.1f}", f"{k}", f"{a + b * k:.1f}"])
    headers = ["ranks", "block", "coordinator peers", "coordinator CPU ms", "per 1,000 ranks", "leader peers"]
    print(table([*headers, "leader CPU ms"], out))


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
    parser.add_argument("--fleet", action="store_true", help="healthy path only, fitted to a fleet")
    parser.add_argument("--hosts-of", type=int, default=8, help="--fleet: ranks per host of the tree (default 8)")
    args = parser.parse_args()
    print(machine())
    if args.fleet:
        fleet(args.worlds if args.worlds != [2, 4, 8, 16, 32] else [2, 4, 8, 16, 32, 64], args.reps, args.hosts_of)
        return
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
