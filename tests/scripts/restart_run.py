"""The restart recipe, end to end: a plain loop under ``torchrun --max-restarts=1``.

Every step is audited with ``on_mismatch="raise", exit_code=17``; every 2 steps a checkpoint is saved
with its sidecar and every rank's resume state (its own RNG stream, saved in its own file; the lr
scheduler; the data position). On the first attempt rank 1 is corrupted at step 6: every rank exits 17
after the record is written (and the evict file, when ``WEIGHTSYNC_EVICT_FILE`` is set, names rank 1's
host: with two ranks the vote is a tie, and attribution's per-step records say which rank changed); torchrun restarts the workers, which resume from the last *verified* checkpoint (checked against
its sidecar before the first step, each rank against its own resume state) and finish in sync.

Usage: python -m torch.distributed.run --nproc_per_node=2 --max-restarts=1 restart_run.py OUT [STEPS]
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch
import torch.distributed as dist

from weightsync_audit import AuditOptions, ResumeSources
from weightsync_audit.engine.attribution.settle import watch_run
from weightsync_audit.engine.checkpoints.sidecar import read_sidecar
from weightsync_audit.integrations.session.options import EXIT_DIVERGED
from weightsync_audit.integrations.session.runner import AuditRunner


def last_verified(folder: Path) -> tuple[int, Path] | None:
    """The newest checkpoint whose sidecar says every replica agreed."""
    found = []
    for p in folder.glob("step*.pt"):
        sidecar = read_sidecar(p)
        if sidecar is not None and sidecar["verdict"] == "verified":
            found.append((int(sidecar["step"]), p))
    return max(found) if found else None


def init_process_group(attempt: int) -> None:
    """``init_process_group`` over the job's store under a prefix per attempt: torchrun (torch 2.13) keeps
    one store across restarts, and a restarted worker that reads the previous attempt's gloo addresses
    fails to connect (measured here: 3 restarts in 4 with a bare ``init_process_group``)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group("gloo")
        return
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def main() -> None:
    faulthandler.dump_traceback_later(90, exit=True)  # a hang shows where
    out = Path(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group(attempt)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    torch.manual_seed(100 + rank)  # each rank its own stream (as dropout would draw)
    runner = AuditRunner(
        AuditOptions(
            on_mismatch="raise", exit_code=EXIT_DIVERGED, report_path=str(out / "audit.jsonl"), attribution=True
        )
    )
    runner.open(world_size=dist.get_world_size(), is_main=rank == 0)
    watch_run(runner, model, [opt])  # attribution: each rank's own step records name the corrupted one
    start, resumed = 0, None
    dist.barrier()
    found = last_verified(out / "ckpt")
    if found is not None:
        start, path = found
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["sched"])
        rng = torch.load(path.with_name(f"{path.stem}.rng{rank}.pt"), weights_only=False)  # this rank's own
        torch.set_rng_state(rng["cpu"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        sources = ResumeSources(lr_schedulers=[sched], data_position={"step": start})
        result = runner.checkpoint(
            "loaded", path, model, [opt], step=start, epoch=0, hook="resume", is_main=rank == 0, resume=sources
        )
        resumed = {"step": start, "status": result.checkpoint["status"] if result else None}
        resumed["resume"] = result.checkpoint["resume"]["status"] if result else None
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step)  # the same batch on every rank: replicas stay equal
        loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        runner.record_step(model, [opt], step)  # the step's record closed (local)
        torch.rand(2)  # this rank's stream moves on
        if attempt == 0 and step == 6 and rank == 1:
            with torch.no_grad():
                model.weight[0, 0] += 1.0  # the planted fault
        runner.run(model, [opt], step=step, epoch=0, hook="step", is_main=rank == 0)
        if step % 2 == 0:
            path = out / "ckpt" / f"step{step}.pt"
            path.parent.mkdir(exist_ok=True)
            if rank == 0:
                torch.save(
                    {"model": model.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict()}, path
                )
            rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
            torch.save(rng, path.with_name(f"{path.stem}.rng{rank}.pt"))
            dist.barrier()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            sources = ResumeSources(lr_schedulers=[sched], data_position={"step": step})
            runner.checkpoint(
                "saved",
                path,
                model,
                [opt],
                state=state,
                step=step,
                epoch=0,
                hook="save",
                is_main=rank == 0,
                resume=sources,
            )
    runner.close()
    digest = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).sum().item()
    (out / f"end.rank{rank}.json").write_text(json.dumps({"attempt": attempt, "resumed": resumed, "sum": digest}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
