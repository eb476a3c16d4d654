"""Attribution (issue 31) on the accelerator, for ``benchmarks/gpu_check.py``: who is wrong of two replicas, and why.

    python benchmarks/gpu_attribution.py             # on a CUDA machine: 2 ranks sharing cuda:0 (about a minute)
    python benchmarks/gpu_attribution.py --dry-run   # the same checks on 2 CPU ranks, tiny sizes (seconds)

**Two ranks on one GPU.** NCCL refuses two ranks on one device, so the ranks are forked processes in a gloo
process group (``benchmarks/harness.py``'s ``launch``, as ``gpu_overlap.py`` and ``gpu_check.py``'s
resync rows do) whose model, optimizer state, gradients and DDP buckets all live on ``cuda:0``: gloo
all-reduces the CUDA gradient buckets and the audit reads the CUDA tensors (its digests on the device).
The forks happen before this process touches CUDA (it never does: ``run()`` only forks).

The faults are the CPU proofs' (``tests/attribution_faults.py``, run by ``benchmarks/campaign_attribution.py``'s
``run_fault``: plain DDP + Adam, ``LoopAudit(attribution=True)`` every step), now on the device, each on one
rank at step 4; the truth is what was injected (the rank, and the evidence its kind must give, from
``ATTRIBUTION_FAULTS``), scored with the campaign's ``score`` on the first divergent record:

- ``bit flip at rest`` (rank 0, and rank 1): blamed on that rank, ``at_rest_change``, ``hardware_suspect``;
- ``update off by one ulp`` (rank 0, and rank 1): that rank, ``update_not_reproducible``, hardware-suspect;
- ``gradient changed after the all-reduce`` (a local change of the reduced gradient before the step): that
  rank, ``deterministic_difference`` (the replayed update reproduces both results: software, not the machine);
- ``all-reduce result changed`` (DDP's reduced bucket altered on one rank, inside the comm hook):
  ``collective_mismatch``; with two ranks no majority names the rank (undecided by design), never the wrong one;
- ``different lr on one rank``: that rank, ``deterministic_difference``;
- ``healthy``: no divergent record, no blame;
- ``attribution cost``: the step time of DDP + Adam on the device with no attribution, the at-rest digests,
  the collective check and the replay of every update (``benchmarks/bench_attribution.py``'s
  ``step_times``), as ratios to no attribution, measured in one run; right when the healthy loop's watch saw
  nothing change at rest.

Every rank must take the same decision: a blame that differs across the two ranks is a wrong answer.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: F401 - first: it puts this checkout and tests/ on sys.path
import torch
from attribution_faults import Fault
from bench_attribution import step_times
from campaign_attribution import run_fault, score
from gpu_overlap import check_device, standalone
from harness import launch

Row = tuple[str, str, "bool | None", str]

KINDS: tuple[tuple[str, str | None, tuple[int, ...]], ...] = (
    ("healthy", None, (0,)),
    ("bit flip at rest", "flip_at_rest", (0, 1)),
    ("update off by one ulp", "update_ulp", (0, 1)),
    ("gradient changed after the all-reduce", "grad_after_reduce", (1,)),
    ("different lr on one rank", "lr_one_rank", (0,)),
    ("all-reduce result changed", "collective_bytes", (1,)),  # last: its auditor keeps its comm hook's DDP
)
"""Row label, fault kind (``None``: healthy), the ranks it is injected on (one run each)."""


def _faults() -> list[Fault]:
    return [Fault(kind, rank=r) for _, kind, ranks in KINDS for r in ranks]


def _all_runs(rank: int, world: int, device: str) -> list[list[dict[str, Any]]]:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return [run_fault(rank, world, fault, 1, device) for fault in _faults()]


def _said(s: dict[str, Any]) -> str:
    blame = s.get("blame")
    if s["kind"] == "healthy":
        return "no false alarm" if not s["false_alarm"] else "FALSE ALARM"
    if not blame:
        return f"on rank {s['rank']}: no blame ({'detected' if s['detected'] else 'not detected'})"
    who = f"rank {blame['ranks'][0]}" if blame["ranks"] else "no rank (undecided)"
    hw = ", HARDWARE SUSPECT" if blame["hardware_suspect"] else ""
    return f"on rank {s['rank']}: blamed {who}, {blame['evidence']}{hw}, step {blame.get('step')}"


def right_answer(s: dict[str, Any]) -> bool:
    """Whether a scored run (``campaign_attribution.score``) is a right answer for its kind."""
    if s["kind"] == "healthy":
        return not s["false_alarm"]
    if s["kind"] == "collective_bytes":  # two ranks: the class, and never the wrong rank
        return (
            bool(s["blame"]) and s["class_right"] and s["blame"]["ranks"] in ([], [s["rank"]]) and s["hardware_right"]
        )
    return s["verdict"] == "correct" and s["hardware_right"]


def check_kinds(device: torch.device, size: str) -> list[Row]:
    """One row per fault kind: every injected run named right, the same blame on both ranks."""
    per_rank = launch(_all_runs, 2, str(device), timeout=300)
    rows: list[Row] = []
    runs = iter(zip(_faults(), per_rank[0], per_rank[1]))
    for label, _, ranks in KINDS:
        said, ok = [], True
        for _ in ranks:
            fault, mine, theirs = next(runs)
            s = score(fault, mine)
            same = [r.get("blame") for r in mine] == [r.get("blame") for r in theirs]
            ok &= right_answer(s) and same
            said.append(_said(s) + ("" if same else "; the ranks' blames DIFFER"))
        rows.append((f"attribution: {label}", size, ok, "; ".join(said)))
    return rows


def check_cost(device: torch.device, dry: bool) -> Row:
    """The step time with each attribution option against none, on 2 ranks sharing the device."""
    width, layers, batch, steps, rounds = (64, 2, 16, 4, 1) if dry else (2048, 4, 512, 10, 3)
    got = launch(step_times, 2, width, layers, batch, steps, rounds, str(device), timeout=300)
    times, moved = got[0]["times"], got[0]["moved_at_rest"] + got[1]["moved_at_rest"]
    base = times["none"]
    ratios = ", ".join(f"{k} x{v:.3f}" for k, v in got[0]["ratios"].items() if k != "none")
    params = layers * (width * width + width)
    return (
        "attribution cost",
        f"MLP {params / 1e6:.3g}M, Adam",
        not moved and all(v > 0 for v in times.values()),
        f"step {base * 1e3:.1f} ms with none; {ratios}" + (f"; WRONG, moved at rest: {moved[:3]}" if moved else ""),
    )


def run(device: torch.device | None = None, dry: bool = False) -> list[Row]:
    """Every attribution check as rows ``(check, size, ok, figures)`` (``ok``: True, False, or None: skipped)."""
    device = check_device(device, dry)
    where = "2 ranks, 1 device" if device.type != "cpu" else "2 CPU ranks (dry run)"
    rows: list[Row] = []
    for check in (lambda: check_kinds(device, where), lambda: [check_cost(device, dry)]):
        try:
            rows += check()
        except Exception as exc:  # noqa: BLE001 - a crash is a wrong answer, reported in the table
            rows.append(("attribution", where, False, f"raised {type(exc).__name__}: {str(exc)[:160]}"))
    return rows


def main() -> None:
    """Run as a script (``--dry-run``: on the CPU)."""
    standalone(run, __doc__ or "", "the same checks on 2 CPU ranks at tiny sizes")


if __name__ == "__main__":
    main()
