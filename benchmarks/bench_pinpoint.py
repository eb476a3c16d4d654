"""What pinpoint costs per optimizer step, against a plain training step and a memory copy, same run.

    python benchmarks/bench_pinpoint.py                  # 100M fp32 parameters, SGD with momentum
    python benchmarks/bench_pinpoint.py --batch 16 --reps 5

``Auditor(pinpoint=True).record_step(step)`` digests, locally, everything the audit covers (here the
parameters and SGD's momentum: 0.8 GB), once per optimizer step. It is compared with, in the same
process on the same tensors: a training step of the model (forward, backward, ``optimizer.step``) on a
batch of ``--batch`` rows; ``optimizer.step`` alone; and a copy of the audited bytes (``copy_`` into a
buffer allocated once: memory bandwidth, no page faults). It is
measured for full per-step digests (exact pinpoint) and for sampled ones (``pinpoint_coverage``).
Threads: torch and the digest each use the cores this process may run on (``WEIGHTSYNC_AUDIT_THREADS``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from harness import machine, median, table, timed
from torch import nn

from weightsync_audit import Auditor
from weightsync_audit.engine.hashing.digest import workers


def mlp(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())))
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02)
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2896)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(workers())
    model = mlp(args.width, args.layers)
    params = sum(q.numel() for q in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(args.batch, args.width)

    def train_step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()

    train_step()  # momentum buffers now exist: the audit covers them
    audited = [q for q in model.parameters()] + [opt.state[q]["momentum_buffer"] for q in model.parameters()]
    audited_bytes = sum(t.nbytes for t in audited)
    spare = [torch.empty_like(t) for t in audited]
    step = [0]

    def recorder(coverage: str) -> Auditor:
        return Auditor(model, opt, pinpoint=True, pinpoint_coverage=coverage)

    exact, sampled = recorder("1"), recorder("1/8")

    def record(a: Auditor) -> None:
        step[0] += 1
        a.record_step(step[0])

    rows_spec = [
        ("training step (forward, backward, SGD step)", train_step),
        ("optimizer.step() alone", opt.step),
        (
            "copy of the audited bytes (into a preallocated buffer)",
            lambda: [d.copy_(t) for d, t in zip(spare, audited)],
        ),
        ("pinpoint record_step, exact (coverage 1)", lambda: record(exact)),
        ("pinpoint record_step, sampled (coverage 1/8)", lambda: record(sampled)),
    ]
    times = {name: median(timed(fn, args.reps)) for name, fn in rows_spec}
    base = times[rows_spec[0][0]]
    copy = times[rows_spec[2][0]]
    rows = [
        [name, f"{t * 1e3:.1f}", f"{t / base:.3f}", f"{t / copy:.2f}", f"{audited_bytes / t / 1e9:.1f}"]
        for name, t in times.items()
    ]
    print(f"# {machine()}")
    print(
        f"# MLP {args.layers} x Linear({args.width}, {args.width}): {params / 1e6:.1f}M fp32 parameters; audited: "
        f"parameters + SGD momentum = {audited_bytes / 1e9:.2f} GB; batch {args.batch}; {workers()} thread(s); "
        f"median of {args.reps}"
    )
    print(table(["per step", "ms", "x training step", "x memory copy", "GB/s of audited bytes"], rows))


if __name__ == "__main__":
    main()
