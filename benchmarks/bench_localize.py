"""Bytes through any rank when a divergence is localized: one round (every digest column to the
coordinator) against two rounds (bucket digests, then only the differing buckets' entries).

    python benchmarks/bench_localize.py                        # 2..32 ranks, 1,000 and 100,000 entries
    python benchmarks/bench_localize.py --worlds 2,4,16 --entries 1000
    python benchmarks/bench_localize.py --kernel --entries 1000   # and loopback bytes (root, unshare -n)

What is counted: the audit channel's own count of the bytes each rank hands to gloo (``Comm.sent_bytes``:
frames and bodies, the payloads only, no TCP/IP headers). With ``--kernel`` (root: the script reruns itself
under ``unshare -n`` with its own loopback up) the whole audits are also counted by the kernel: every byte
through the private namespace's ``lo`` (payloads, gloo's handshakes, TCP/IP and link headers, ACKs, the data
plane's transfer), read from ``/proc/net/dev`` on rank 0 between barriers, less one barrier's bytes. Every message goes through the coordinator (rank 0), so the
bytes through rank 0 are its own sends plus every other rank's sends, and that is the most through any
rank; a peer's traffic is its sends plus the answers it gets (rank 0's sends / (W - 1)).

Two measurements, both on real forked gloo ranks:

- ``columns``: the localization exchanges alone (``compare_columns`` over synthetic digests), one entry
  diverged on rank 1, with the bucketed rounds on and off (``BUCKETS_FROM`` raised past the size), and as
  an audit runs them: after the summary's bucket sketch (``localize_values`` on the candidate buckets);
- ``audit``: a whole divergent ``Auditor.audit`` of a model of ``--audit-entries`` small tensors, one of
  them changed on rank 1 (summary, localization, gap transfer, second read, hints, hosts), against a
  healthy audit of the same model.

The 1,024-rank, 100,000-entry figure is extrapolated from the per-peer bytes at 100,000 entries (the
coordinator's traffic is (W - 1) times the traffic with one peer, which the measurements show constant
in W), times 1,023.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from harness import launch, machine, table

from weightsync_audit import Auditor
from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.agreement import rounds


def _columns(rank: int, world: int, n: int, bucketed: bool) -> int:
    if not bucketed:
        rounds.BUCKETS_FROM = 1 << 62
    comm = Comm(timeout_s=300)
    comm.setup()
    digests = np.arange(n, dtype=np.int64) * 7919
    if rank == 1:
        digests[n // 2] = -1
    before = comm.sent_bytes
    diffs = rounds.compare_columns(comm, [str(i) for i in range(n)], digests)
    assert [d.uid for d in diffs] == [str(n // 2)]
    return comm.sent_bytes - before


def _sketched(rank: int, world: int, n: int) -> int:
    """The localization after the summary's bucket sketch: the candidate buckets named by a real summary
    round (not counted: a healthy audit pays for it), then :func:`rounds.localize_values`."""
    comm = Comm(timeout_s=300)
    comm.setup()
    digests = np.arange(n, dtype=np.int64) * 7919
    if rank == 1:
        digests[n // 2] = -1
    sketch, full = rounds.bucket_sketch(digests)
    summary = np.concatenate([[1, 0, 0, n, 0, rank == 1, 0, 0, 0], sketch]).astype(np.int64)
    agreed = rounds.agree(comm, summary)
    assert agreed.status == "values" and agreed.candidates is not None
    before = comm.sent_bytes
    diffs = rounds.localize_values(comm, [str(i) for i in range(n)], digests, agreed.candidates, full)
    assert [d.uid for d in diffs] == [str(n // 2)]
    return comm.sent_bytes - before


def _lo_bytes() -> int:
    """Bytes through the loopback interface so far (kernel count: payload, TCP/IP and link headers, ACKs)."""
    time.sleep(0.2)  # let the last ACKs of what came before land
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[0])
    return 0


KERNEL_REPS = 10
"""Calls per kernel count: whether an ACK rides the next data packet or goes alone varies from one call
to the next (one divergent audit at 16 ranks read 3.1 KB and 4.0 KB per peer in two runs), so the
figure is the mean over this many calls."""


def _kernel(fn: Any) -> int:
    """Loopback bytes of one call of collective ``fn`` on rank 0 (the mean of ``KERNEL_REPS``), less a
    barrier's (the fences around them)."""
    dist.barrier()
    a = _lo_bytes()
    for _ in range(KERNEL_REPS):
        fn()
    dist.barrier()
    b = _lo_bytes()
    dist.barrier()
    return round(((b - a) - (_lo_bytes() - b)) / KERNEL_REPS)


def _audit(rank: int, world: int, n: int) -> tuple[int, int, int, int]:
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4)) for _ in range(n)])
    auditor = Auditor(model, timeout_s=300)
    assert auditor.audit(step=0).in_sync  # opens the channel (hosts gathered once, here)
    before = auditor.comm.sent_bytes
    assert auditor.audit(step=1).in_sync
    healthy = auditor.comm.sent_bytes - before
    k_healthy = _kernel(lambda: auditor.audit(step=1))
    if rank == 1:
        with torch.no_grad():
            model[n // 2][0] += 1
    before = auditor.comm.sent_bytes
    result = auditor.audit(step=2)
    assert [m.ranks for m in result.mismatches] == [[1]]
    diverged = auditor.comm.sent_bytes - before
    k_diverged = _kernel(lambda: auditor.audit(step=2))
    return healthy, diverged, k_healthy, k_diverged


def through(sent: list[int]) -> tuple[int, float]:
    """Bytes through rank 0 (its sends and every peer's), and through a peer (its sends and its answers)."""
    w = len(sent)
    return sent[0] + sum(sent[1:]), max(sent[1:]) + sent[0] / (w - 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4,8,16,32")
    p.add_argument("--entries", default="1000,100000")
    p.add_argument("--audit-entries", type=int, default=1000)
    p.add_argument("--json", type=Path)
    p.add_argument("--kernel", action="store_true", help="also count loopback bytes in a private netns (root)")
    args = p.parse_args()
    if args.kernel and not os.environ.get("WSA_PRIVATE_NETNS"):
        os.environ["WSA_PRIVATE_NETNS"] = "1"
        up = 'ip link set lo up && exec "$0" "$@"'
        os.execvp("unshare", ["unshare", "-n", "sh", "-c", up, sys.executable, *sys.argv])
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"# {machine()}", file=sys.stderr)
    raw: dict[str, Any] = {"columns": {}, "audit": {}}
    rows = []
    for n in [int(x) for x in args.entries.split(",")]:
        for w in worlds:
            one = through(launch(_columns, w, n, False))
            two = through(launch(_columns, w, n, True))
            sk = through(launch(_sketched, w, n))
            raw["columns"][f"{n}/{w}"] = {"one_round": one, "two_rounds": two, "sketched": sk}
            rows.append(
                [
                    f"{n:,}",
                    str(w),
                    f"{one[0]:,}",
                    f"{two[0]:,}",
                    f"{two[0] / (w - 1):,.0f}",
                    f"{sk[0]:,}",
                    f"{sk[0] / (w - 1):,.0f}",
                ]
            )
            print(f"  columns n={n} W={w}: rank 0 {one[0]:,} -> {two[0]:,} -> {sk[0]:,} bytes", file=sys.stderr)
    head = ["entries", "ranks", "rank 0, one round", "rank 0, two rounds", "per peer", "rank 0, sketched"]
    print(table([*head, "per peer, sketched"], rows))
    rows = []
    n = args.audit_entries
    kernel = bool(os.environ.get("WSA_PRIVATE_NETNS"))
    for w in worlds:
        out = launch(_audit, w, n)
        healthy, diverged = through([o[0] for o in out]), through([o[1] for o in out])
        k_healthy, k_diverged = out[0][2], out[0][3]
        raw["audit"][str(w)] = {"healthy": healthy, "diverged": diverged}
        row = [str(w), f"{healthy[0] / (w - 1):,.0f}", f"{diverged[0]:,}", f"{diverged[0] / (w - 1):,.0f}"]
        if kernel:
            raw["audit"][str(w)].update(kernel_healthy=k_healthy, kernel_diverged=k_diverged)
            row += [f"{k_healthy / (w - 1):,.0f}", f"{k_diverged:,}", f"{k_diverged / (w - 1):,.0f}"]
        rows.append(row)
    print(f"\nwhole audits, {n:,} tensors, 1 diverged on rank 1 (bytes handed to gloo by the audit channel):")
    head = ["ranks", "healthy, per peer", "divergent, through rank 0", "divergent, per peer"]
    if kernel:  # the whole loopback interface of a private network namespace: every byte on the wire
        head += ["kernel: healthy, per peer", "kernel: divergent, all", "kernel: divergent, per peer"]
    print(table(head, rows))
    big = [k for k in raw["columns"] if k.startswith("100000/")]
    if big:

        def peer(k: str, how: str) -> float:
            return raw["columns"][k][how][0] / (int(k.split("/")[1]) - 1)

        per_peer, one_peer = max(peer(k, "two_rounds") for k in big), max(peer(k, "one_round") for k in big)
        sketched = max(peer(k, "sketched") for k in big)
        print(
            f"\nextrapolated, 1,024 ranks, 100,000 entries, 1 diverged: through rank 0 {sketched * 1023 / 1e6:.2f} MB "
            f"after the summary's sketch, {per_peer * 1023 / 1e6:.2f} MB in two rounds without it (one round: "
            f"{one_peer * 1023 / 1e6:.0f} MB); goal < 10 MB"
        )
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
