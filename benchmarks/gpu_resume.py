"""Resume fidelity (issue 32) with the CUDA generator, for ``benchmarks/gpu_check.py``: each rank gets back its own RNG.

    python benchmarks/gpu_resume.py             # on a CUDA machine: 2 ranks sharing cuda:0 (seconds)
    python benchmarks/gpu_resume.py --dry-run   # 2 CPU ranks; the CUDA row is skipped, with the reason

Two forked ranks in a gloo process group (NCCL refuses two ranks on one device), the model on ``cuda:0``
(``benchmarks/harness.py``'s ``launch``; this process never touches CUDA). Each rank seeds its own
streams (torch CPU and CUDA, numpy, Python ``random``; ``100 + rank``), trains a few steps drawing from
them (dropout on the device), saves its RNG file (``cpu``, ``cuda``, ``numpy``, ``python``) and the
checkpoint through ``LoopAudit.checkpoint_saved(resume=ResumeSources(...))``, then resumes three ways,
each after re-seeding everything elsewhere (a fresh process):

- ``clean``: every rank loads its own file: the record says ``exact`` with no finding (and, on a GPU,
  the sidecar holds each rank's CUDA generator, ``rng.cuda``);
- ``rank 1 with rank 0's RNG``: rank 1 loads rank 0's file: the record names rank 1 and rank 0 for
  every generator the swap moved;
- ``CUDA RNG from rank 0`` (GPU only): rank 1 keeps its own CPU, numpy and Python states but loads rank 0's
  CUDA generator: the record names exactly the CUDA RNG state. In a dry run the row is ``skipped``.

The truth is computed, not assumed: after each restore the ranks gather every rank's saved and current
generator states, and each (rank, generator) whose state equals another rank's saved one (and not its
own) must be named with that rank, one equal to no saved state as not restored, and nothing else.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: F401 - first: it puts this checkout and tests/ on sys.path
import numpy as np
import torch
import torch.distributed as dist
from gpu_overlap import check_device, standalone
from harness import launch
from torch import nn

from weightsync_audit import LoopAudit, ResumeSources

Row = tuple[str, str, "bool | None", str]

GENERATORS = {"cpu": "rng.torch", "cuda": "rng.cuda", "numpy": "rng.numpy", "python": "rng.python"}
"""The RNG file's keys and the resume record's components."""

SCENARIOS = ("clean", "rng_from_rank0", "cuda_rng_from_rank0")


def _rng_state(cuda: bool) -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a.cpu(), b.cpu())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def truth(saved: list[dict[str, Any]], now: list[dict[str, Any]]) -> dict[tuple[int, str], int | None]:
    """(rank, component) -> the rank whose saved state it resumed with, ``None``: none; only the wrong ones."""
    out: dict[tuple[int, str], int | None] = {}
    for r, mine in enumerate(now):
        for key, value in mine.items():
            if _same(value, saved[r][key]):
                continue
            others = [q for q in range(len(saved)) if q != r and _same(value, saved[q][key])]
            out[(r, GENERATORS[key])] = others[0] if others else None
    return out


def claims(findings: list[dict[str, Any]]) -> dict[tuple[int, str], int | None]:
    """The same map, as the resume record's RNG findings say it."""
    out: dict[tuple[int, str], int | None] = {}
    for f in findings:
        for comp in f.get("components") or [f["component"]]:
            if comp.startswith("rng."):
                for r in f["ranks"]:
                    out[(int(r), comp)] = f["from_ranks"][0] if f["from_ranks"] else None
    return out


def _resume_rank(rank: int, world: int, device: str, folder: str) -> dict[str, Any]:
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    torch.manual_seed(100 + rank)  # every generator its own stream per rank (CUDA's too)
    np.random.seed(100 + rank)
    random.seed(100 + rank)
    audit = LoopAudit(model, opt, on_mismatch="warn", verbose=False)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16, device=dev)).sum().backward()  # dropout draws from the device's generator
        opt.step()
        sched.step()
        np.random.rand(), random.random()
    path = Path(folder) / "step3.pt"
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
    torch.save(_rng_state(cuda), Path(folder) / f"rng{rank}.pt")
    dist.barrier()
    saved = audit.checkpoint_saved(path, 3, resume=ResumeSources(lr_schedulers=[sched]))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, _rng_state(cuda))
    seen: dict[str, Any] = {"saved": saved.checkpoint["resume"]["checked"] if saved else [], "cuda": cuda}
    for scenario in SCENARIOS:
        if scenario == "cuda_rng_from_rank0" and not cuda:
            continue
        torch.manual_seed(1234)  # a fresh process: the generators start elsewhere
        np.random.seed(1234)
        random.seed(1234)
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        own = torch.load(Path(folder) / f"rng{rank}.pt", weights_only=False)
        rank0 = torch.load(Path(folder) / "rng0.pt", weights_only=False)
        if rank == 1 and scenario == "rng_from_rank0":
            own = rank0  # rank 1's RNG file replaced by rank 0's
        elif rank == 1 and scenario == "cuda_rng_from_rank0":
            own = {**own, "cuda": rank0["cuda"]}
        _set_rng(own)
        now: list[Any] = [None] * world
        dist.all_gather_object(now, _rng_state(cuda))
        result = audit.checkpoint_loaded(path, 3, resume=ResumeSources(lr_schedulers=[sched]))
        resume = result.checkpoint["resume"] if result is not None else {"status": "none", "findings": []}
        seen[scenario] = {"truth": truth(gathered, now), "resume": resume}
    audit.close()
    return seen


def _row(label: str, size: str, seen: dict[str, Any], scenario: str) -> Row:
    got = seen[scenario]
    said, planted = claims(got["resume"]["findings"]), got["truth"]
    status = got["resume"]["status"]
    ok = said == planted and status == ("exact" if not planted else "differs")
    details = [f["detail"] for f in got["resume"]["findings"]] or ["no finding"]
    figures = f"{status}: {'; '.join(details)}"
    if scenario == "clean":
        has_cuda = "rng.cuda" in seen["saved"]
        ok &= has_cuda == seen["cuda"]
        figures += f"; saved {', '.join(c for c in seen['saved'] if c.startswith('rng.'))}"
    if not ok:
        figures += f"; WRONG: truth {sorted(planted.items())}, record {sorted(said.items())}"
    return (f"resume: {label}", size, ok, figures)


def run(device: torch.device | None = None, dry: bool = False) -> list[Row]:
    """Every resume check as rows ``(check, size, ok, figures)`` (``ok``: True, False, or None: skipped)."""
    device = check_device(device, dry)
    size = "2 ranks, 1 device" if device.type != "cpu" else "2 CPU ranks (dry run)"
    with tempfile.TemporaryDirectory() as tmp:
        seen = launch(_resume_rank, 2, str(device), tmp, timeout=240)[0]
    rows = [
        _row("clean", size, seen, "clean"),
        _row("rank 1 with rank 0's RNG", size, seen, "rng_from_rank0"),
    ]
    if "cuda_rng_from_rank0" in seen:
        rows.append(_row("CUDA RNG from rank 0", size, seen, "cuda_rng_from_rank0"))
    else:
        why = "no CUDA generator in a dry run on the CPU (the model is not on a CUDA device)"
        rows.append(("resume: CUDA RNG from rank 0", size, None, why))
    return rows


def main() -> None:
    """Run as a script (``--dry-run``: on the CPU)."""
    standalone(run, __doc__ or "", "2 CPU ranks; the CUDA row skipped")


if __name__ == "__main__":
    main()
