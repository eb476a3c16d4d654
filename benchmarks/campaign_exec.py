"""Running the combination campaign's cases: one set of forked gloo ranks per world size runs many cases in
sequence (plain loops and Trainers alike); a case that has not reported by its deadline is a hang, its ranks
are killed and the rest go on in fresh ones.

Each rank runs the case (:func:`run_case`), then every rank's bytes are gathered and compared
(:func:`campaign_truth.gather`); rank 0 hands the parent the records of the report, the classes of equal
bytes and how each rank ended.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import harness  # noqa: F401 - puts the repository and tests/ on the path (ranks.py)
from campaign_case import Case

RUN_TIMEOUT_S = 150.0
"""A case that has not reported within this many seconds is a hang (its ranks are killed)."""
PG_TIMEOUT_S = 60.0
"""The process group's own timeout: a rank left alone in DDP's all-reduce fails after it, not never."""


def _runner(adapter: str) -> Callable[..., Any]:
    if adapter == "loop":
        from campaign_loop import run_loop

        return run_loop
    from campaign_trainers import run_hf, run_lightning

    return run_lightning if adapter == "lightning" else run_hf


def read_records(path: Path) -> list[dict[str, Any]]:
    """The report's records (rank 0 wrote them), without the fields that differ by rank or run."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out.append({k: v for k, v in rec.items() if k not in ("time", "duration_ms")})
    return out


def run_case(case: Case, rank: int, world: int) -> dict[str, Any] | None:
    """Run ``case`` on this rank, gather the truth; rank 0 returns what the parent scores (others ``None``)."""
    import torch.distributed as dist
    from campaign_truth import gather

    report = Path(tempfile.gettempdir()) / f"weightsync-pairs-{os.getppid()}-{case.run_id}.jsonl"
    if rank == 0 and report.exists():
        report.unlink()
    dist.barrier()
    try:
        cap, out = _runner(case.adapter)(case, rank, world, str(report))
    except Exception as exc:  # noqa: BLE001 - the set-up itself failed: a crash of this case
        cap, out = None, {"error": f"{type(exc).__name__}: {exc} | {traceback.format_exc()[-400:]}"}
    statuses: list[Any] = [None] * world
    dist.all_gather_object(statuses, {**out, "captured": cap is not None})
    truth = gather(cap, world, classify=rank == 0) if cap is not None and all(s["captured"] for s in statuses) else None
    if rank != 0:
        return None
    records = read_records(report)
    if report.exists():
        report.unlink()
    return {"records": records, "truth": truth, "statuses": statuses}


def _rank_main(cases: list[Case], rank: int, world: int, port: int, q: Any) -> None:
    from ranks import join_group, leave

    gc.freeze()  # what the parent imported is never garbage: the collector does not walk it (a fifth of the CPU)
    os.dup2(2, 1)  # what the Trainers print goes to stderr: the parent's stdout carries the report only
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", GROUP_RANK="0",
    )  # fmt: skip
    try:
        join_group(rank, world, port, PG_TIMEOUT_S)
        for case in cases:
            try:
                res = run_case(case, rank, world)
            except Exception as exc:  # noqa: BLE001 - the gather failed: this set of ranks is done
                if rank == 0:
                    q.put((case.run_id, pickle.dumps({"fatal": f"{type(exc).__name__}: {exc}"})))
                break
            if rank == 0:
                q.put((case.run_id, pickle.dumps(res)))
            if res is not None and any(s.get("error") for s in res["statuses"]):
                break  # a crashed case may leave the channel unusable: the parent starts fresh ranks
    finally:
        leave(q)


def fork_ranks(target: Callable[..., None], work: list[Any], world: int) -> tuple[list[Any], Any]:
    """``world`` forked processes running ``target(work, rank, world, port, queue)``, started; and the queue."""
    from ranks import free_port

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(work, r, world, port, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return procs, q


def reap(procs: list[Any], grace_s: float) -> None:
    """Wait ``grace_s`` for each process to leave by itself, then kill it (after a hang: at once)."""
    for p in procs:
        p.join(timeout=grace_s)
        if p.is_alive():
            p.kill()
            p.join()


def _batch(cases: list[Case], timeout_s: float, on_result: Callable[[Case, Any], None]) -> None:
    """Run ``cases`` (one world size) in one set of forked ranks until one hangs, crashes or all are done."""
    procs, q = fork_ranks(_rank_main, cases, cases[0].world)
    by_id = {c.run_id: c for c in cases}
    seen: set[str] = set()
    grace = 2.0
    try:
        for _ in cases:
            try:
                run_id, payload = q.get(timeout=timeout_s)
            except queue.Empty:
                on_result(next(c for c in cases if c.run_id not in seen), "hang")
                grace = 0.0
                break
            res = pickle.loads(payload)
            seen.add(run_id)
            on_result(by_id[run_id], res)
            if "fatal" in res or any(s.get("error") for s in res["statuses"]):
                break
    finally:
        reap(procs, grace)


class Executor:
    """Runs cases by world size in sets of forked ranks, restarting after a hang or a crash."""

    def __init__(self, timeout_s: float = RUN_TIMEOUT_S, log: Callable[[Case, Any], None] | None = None) -> None:
        self.timeout_s, self.log = timeout_s, log
        self.results: dict[str, Any] = {}

    def on_result(self, case: Case, res: Any) -> None:
        self.results[case.run_id] = res
        if self.log is not None:
            self.log(case, res)

    def run(self, cases: list[Case]) -> dict[str, Any]:
        _preload({c.adapter for c in cases})
        while True:
            left = [c for c in cases if c.run_id not in self.results]
            if not left:
                return self.results
            world = left[0].world
            batch = [c for c in left if c.world == world]
            before = len(self.results)
            _batch(batch, self.timeout_s, self.on_result)
            if len(self.results) == before:  # the ranks died before reporting anything
                self.on_result(batch[0], {"fatal": "the ranks ended before reporting"})


def _preload(adapters: set[str]) -> None:
    """Import what the ranks need once, here: every forked rank inherits it (a Trainer's imports take seconds)."""
    import torch._dynamo  # noqa: F401 - DDP imports it lazily

    if "lightning" in adapters:
        import pytorch_lightning  # noqa: F401
    if "hf" in adapters:
        from torchrun import OFFLINE

        for k, v in OFFLINE.items():
            os.environ.setdefault(k, v)
        import transformers  # noqa: F401
