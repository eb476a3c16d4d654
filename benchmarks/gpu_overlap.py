"""The overlapped audit on an accelerator, for ``benchmarks/gpu_check.py`` (and the other helpers' checks).

- :func:`check_ranks`: 2 ranks sharing the device, DDP (gloo) with Adam, ``LoopAudit(overlap=True)`` every
  step: steps 1-2 in sync, a drift planted on rank 1 after step 3 found *at step 3* (the record's
  ``overlap.covers_step``), settled before step 4's optimizer step;
- :func:`check_step_ratio`: one process, an MLP trained on the device with the same batch every step,
  blocks of steps with no audit, the synchronous every-step audit and the overlapped one (its digest on a
  side stream that waits, by an event, for the optimizer step), alternating; the step-time ratios, and
  the overlapped digest's rate (audited bytes over the worker's time, while the training runs) against a
  device-to-device copy of the same bytes on an idle device;
- :func:`optional_checks`: the checks other work adds to the table when its module exists here
  (``benchmarks/gpu_megatron.py``, ``gpu_attribution.py``, ``gpu_resume.py``, each with a ``run()``);
  a module not there yet is a ``skipped`` row, never an error.

On the CPU (``--dry-run``) the same code runs at small sizes: the side stream is then not used (a CPU has
no streams) and the figures say nothing about a GPU.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from harness import launch
from torch import nn

from weightsync_audit import LoopAudit, compat

Row = tuple[str, str, "bool | None", str]


def _sync(device: torch.device) -> None:
    compat.synchronize(device)


def _records(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# -- 2 ranks sharing the device ----------------------------------------------------------------------


def _ranks_rank(rank: int, world: int, device: str, report: str) -> dict[str, Any]:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 64)).to(dev)
    ddp = nn.parallel.DistributedDataParallel(net, device_ids=[dev.index or 0] if dev.type == "cuda" else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    audit = LoopAudit(ddp, opt, every_n_steps=1, overlap=True, on_mismatch="warn", report_path=report)
    audit.runner.verbose = False
    for step in range(1, 6):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(step + 10 * rank)).to(dev)
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if rank == 1 and step == 3:
            with torch.no_grad():
                net[0].weight[0, 0] += 1e-3  # drifts before the audit of step 3 is launched
        audit.step(step)
    audit.close()
    return {"side_stream": dev.type == "cpu" or _side_stream_used(dev)}


def _side_stream_used(dev: torch.device) -> bool:
    from weightsync_audit.engine.overlap import StreamOrder

    return any(d.type == dev.type for d in StreamOrder.devices())


def check_ranks(device: torch.device) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "r.jsonl")
        got = launch(_ranks_rank, 2, str(device), report, timeout=240)
        records = _records(report)
    verdicts = [(r["step"], r["in_sync"], r["overlap"]["covers_step"], r["overlap"]["settled_at"]) for r in records]
    first = next((r for r in records if not r["in_sync"]), None)
    ok = (
        [v[1] for v in verdicts] == [True, True, False, False, False]
        and all(v[0] == v[2] for v in verdicts)
        and first is not None
        and first["step"] == 3
        and first["mismatches"][0]["name"] == "0.weight"
        and all(r["side_stream"] for r in got)
    )
    where = "side stream used" if device.type != "cpu" else "CPU: no stream"
    return ok, (
        f"in sync by step: {[v[1] for v in verdicts]}; first divergence covers step "
        f"{first['step'] if first else None} ({first['mismatches'][0]['name'] if first else '-'}); {where}; "
        f"settled at {sorted({v[3] for v in verdicts})}"
    )


# -- step time ratio and the digest's rate -------------------------------------------------------------


def check_step_ratio(device: torch.device, dry: bool, rounds: int = 3, steps: int = 10) -> tuple[bool, str]:
    width, depth, batch = (256, 3, 64) if dry else (8192, 6, 4096)  # on a GPU: 403M params, 4.8 GB audited
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    net = nn.Sequential(*layers).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-5)
    x = torch.randn(batch, width, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "r.jsonl")
        audits: dict[str, LoopAudit | None] = {
            "none": None,
            "sync": LoopAudit(net, opt, every_n_steps=1, verbose=False),
            "overlap": LoopAudit(net, opt, every_n_steps=1, overlap=True, verbose=False, report_path=report),
        }
        step = 0

        def one(audit: LoopAudit | None) -> None:
            nonlocal step
            step += 1
            opt.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            opt.step()
            if audit is not None:
                audit.step(step)

        for a in audits.values():
            for _ in range(2):
                one(a)
            if a is not None:
                a.settle()
        blocks: dict[str, list[float]] = {k: [] for k in audits}
        for r in range(rounds):
            for name in list(audits) if r % 2 == 0 else list(audits)[::-1]:
                a = audits[name]
                one(a)  # untimed: the overlapped audit in its steady state
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    one(a)
                _sync(device)
                blocks[name].append((time.perf_counter() - t0) / steps)
                if a is not None:
                    a.settle()
        for a in audits.values():
            if a is not None:
                a.close()
        records = _records(report)
    med = {k: statistics.median(v) for k, v in blocks.items()}
    audited = sum(p.nbytes for p in net.parameters()) + sum(
        t.nbytes for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)
    )
    worker_s = statistics.median(r["overlap"]["audit_ms"] for r in records) / 1e3
    waited = statistics.median(r["overlap"]["waited_ms"] for r in records)
    copy_rate = _copy_rate(net, opt, device)
    ok = all(r["in_sync"] for r in records) and (dry or _side_stream_used(device))
    ratio = {k: med[k] / med["none"] for k in med}
    return ok, (
        f"step {med['none'] * 1e3:.1f} ms; sync x{ratio['sync']:.4f}, overlap x{ratio['overlap']:.4f} "
        f"(waited {waited:.2f} ms/step); overlapped audit {worker_s * 1e3:.1f} ms for {audited / 1e9:.3g} GB "
        f"= {audited / worker_s / 1e9:.3g} GB/s while training, d2d copy {copy_rate / 1e9:.3g} GB/s idle "
        f"({100 * audited / worker_s / copy_rate:.0f}%)"
    )


def _copy_rate(net: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> float:
    tensors = [p.data for p in net.parameters()]
    tensors += [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim()]
    twins = [torch.empty_like(t) for t in tensors]
    size = sum(t.nbytes for t in tensors)
    for a, b in zip(twins, tensors):
        a.copy_(b)
    _sync(device)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for a, b in zip(twins, tensors):
            a.copy_(b)
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return size / statistics.median(ts)


# -- the other helpers' checks, when their modules are here ---------------------------------------------

OPTIONAL = (
    ("attribution", "gpu_attribution"),
    ("resume", "gpu_resume"),
    ("Megatron hash check", "gpu_megatron"),
)
"""In the order they run: the ones that fork ranks first; Megatron's last, since it opens a process group (and,
on a GPU, CUDA) in this process, after which a forked rank can neither open its own group nor use CUDA."""


def optional_checks(device: torch.device, dry: bool) -> list[Row]:
    """One or more rows per module present (``run()``'s answer), a ``skipped`` row per module absent."""
    rows: list[Row] = []
    for label, name in OPTIONAL:
        if not (Path(__file__).resolve().parent / f"{name}.py").exists():
            rows.append((label, "-", None, f"benchmarks/{name}.py not in this checkout"))
            continue
        try:
            rows.extend(_rows(label, _call(importlib.import_module(name).run, device, dry)))
        except Exception as exc:  # noqa: BLE001 - a crash is a wrong answer, reported in the table
            rows.append((label, "-", False, f"raised {type(exc).__name__}: {str(exc)[:160]}"))
    return rows


def _call(run: Callable[..., Any], device: torch.device, dry: bool) -> Any:
    params = inspect.signature(run).parameters
    kw = {k: v for k, v in (("device", device), ("dry", dry), ("dry_run", dry)) if k in params}
    return run(**kw)


def _rows(label: str, answer: Any) -> list[Row]:
    """``run()`` may answer ``(ok, figures)``, ``(check, size, ok, figures)``, a dict, or a list of these."""
    if isinstance(answer, list) and len(answer) == 4 and isinstance(answer[0], str):  # one row, as gpu_megatron's
        ok = {"ok": True, "WRONG": False, "skipped": None}.get(answer[2], answer[2])
        return [(f"{label}: {answer[0]}", str(answer[1]), ok, str(answer[3]))]
    if isinstance(answer, list):
        return [r for a in answer for r in _rows(label, a)]
    if isinstance(answer, dict):
        return [(str(answer.get("check", label)), str(answer.get("size", "-")), answer.get("ok"),
                 str(answer.get("figures", "")))]  # fmt: skip
    if isinstance(answer, tuple) and len(answer) == 4:
        return [(str(answer[0]), str(answer[1]), answer[2], str(answer[3]))]
    if isinstance(answer, tuple) and len(answer) == 2:
        return [(label, "-", answer[0], str(answer[1]))]
    return [(label, "-", False, f"run() answered {answer!r:.160}, not (ok, figures)")]


def check_device(device: torch.device | None, dry: bool) -> torch.device:
    """The device a check module's ``run()`` uses: the one given, else ``cuda:0`` when there is one and not ``dry``."""
    if device is not None:
        return device
    return torch.device("cpu" if dry or not torch.cuda.is_available() else "cuda", None if dry else 0)


def standalone(run: Callable[..., list[Row]], doc: str, dry_help: str) -> None:
    """A check module run as a script: ``--dry-run``, its rows as a table, exit status 1 on a wrong answer."""
    import argparse
    import sys

    from harness import machine, table

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help=dry_help)
    rows = run(dry=ap.parse_args().dry_run)
    print(machine())
    answers = {True: "ok", False: "WRONG"}
    print(table(["check", "size", "answer", "figures"], [[c, s, answers.get(o, "skipped"), f] for c, s, o, f in rows]))
    sys.exit(1 if any(r[2] is False for r in rows) else 0)
