"""Real torchft jobs for tests: a lighthouse on localhost and replica groups as forked processes.

Each replica group is its own job: its own TCPStore, one process per group rank, a torchft ``Manager``
that meets the others through the lighthouse. Nothing is mocked: the quorum, the heals (torchft's HTTP
checkpoint transport) and the averaging are torchft's own, on CPU gloo. A group can kill itself with
SIGKILL at a step and be started again, so that it heals from a live peer.

Each process returns its audit records and, for the truth the tests compute themselves, a snapshot of
its state (parameters, optimizer state, scheduler counters) at every audit point, taken by a hook that
runs before the audit's own.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


@contextmanager
def lighthouse(min_replicas: int) -> Iterator[str]:
    """torchft's lighthouse (its Rust server from the wheel) on localhost, in a process of its own, on a port
    it picks itself (no free port guessed and raced for); yields its address. The process loads the Rust
    extension alone: ``torchft/__init__`` imports torch, 1.2 s of every job's start, for a server that uses none."""
    code = (
        "import sys, importlib.util as u; spec = u.find_spec('torchft'); "
        "spec = u.spec_from_file_location('torchft._torchft', [*spec.submodule_search_locations][0] + "
        "'/_torchft' + __import__('sysconfig').get_config_var('EXT_SUFFIX')); m = u.module_from_spec(spec); "
        "spec.loader.exec_module(m); "
        "s = m.LighthouseServer(bind='[::]:0', min_replicas=int(sys.argv[1]), join_timeout_ms=300, quorum_tick_ms=20, "
        "heartbeat_timeout_ms=1500); print(s.address(), flush=True); sys.stdin.read()"
    )
    env = {**os.environ, "RUST_LOG": "warn"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(min_replicas)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline().decode().strip() if ready else ""
        if not line:
            raise RuntimeError("the torchft lighthouse did not start")
        yield f"http://localhost:{line.rpartition(':')[2]}"
    finally:
        proc.kill()
        proc.wait()


@dataclass
class Replica:
    """One replica group's plan."""

    index: int
    group_size: int = 1
    die_at: int | None = None
    """SIGKILL the whole group when its Manager reaches this step (then it is started again)."""
    restarted: dict[str, Any] | None = field(default_factory=dict)
    """What the restarted group does differently (``skip_optimizer``, ...); ``None``: it is not restarted
    (it left the job for good)."""
    extra: dict[str, Any] = field(default_factory=dict)


def _mine(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _local(t: Any) -> torch.Tensor:
    """The bytes this process holds (a DTensor's local shard), as a plain tensor the parent can compare."""
    return _mine(t).detach().clone()


def _state(model: torch.nn.Module, opt: Any, sched: Any) -> dict[str, Any]:
    out = {f"p:{n}": _local(p) for n, p in model.named_parameters()}
    if opt is not None:
        params = [p for g in opt.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            st = opt.state.get(p, {})
            out.update({f"o:{i}:{k}": _local(v) for k, v in st.items() if isinstance(v, torch.Tensor)})
    if sched is not None:
        out["s:last_epoch"] = sched.last_epoch
    return out


def _model(seed: int, width: int = 64, square: int = 0) -> torch.nn.Module:
    """The tests' MLP, 4 -> ``width`` -> 2; ``square``: 4 x Linear(square, square) instead (benchmarks)."""
    torch.manual_seed(seed)
    if square:
        return torch.nn.Sequential(*[torch.nn.Linear(square, square) for _ in range(4)])
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))


def worker(plan: dict[str, Any], q: Any) -> None:
    """One process of a replica group (forked): train, audit, report records and snapshots."""
    torch.set_num_threads(1)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    try:
        q.put(("ok", plan["index"], plan["rank"], pickle.dumps(_train(plan))))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("err", plan["index"], plan["rank"], f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        q.close()
        q.join_thread()
        os._exit(0)


def _train(plan: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    import torch.distributed as dist
    from torchft.manager import Manager, WorldSizeMode
    from torchft.process_group import ProcessGroupGloo

    from weightsync_audit import WeightDivergenceError
    from weightsync_audit.integrations.torchft import TorchFTAudit

    rank, mode = plan["rank"], plan["mode"]
    # The group's store, served by its rank 0 for the whole run (the Manager connects to it).
    box, end = plan["port_box"], time.monotonic() + 30
    if rank == 0:  # on a port it picks: its number handed to the group's other ranks
        _store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        box.value = _store.port
    while not box.value and time.monotonic() < end:
        time.sleep(0.01)
    _store = _store if rank == 0 else dist.TCPStore("127.0.0.1", box.value, is_master=False, wait_for_workers=False)
    if mode == "hsdp":  # FSDP2 within the group (the shard dimension), torchft across groups (replicate)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group(
            "gloo", store=dist.PrefixStore("fsdp", _store), rank=rank, world_size=plan["group_size"]
        )
        model = _model(seed=100, width=plan.get("width", 64), square=plan.get("square", 0))
        fully_shard(model, mesh=init_device_mesh("cpu", (plan["group_size"],), mesh_dim_names=("shard",)))
    else:
        model = _model(
            seed=100 + rank, width=plan.get("width", 64), square=plan.get("square", 0)
        )  # group ranks hold different shards; replicas of a shard start equal
    snapshots: dict[int, dict[str, Any]] = {}
    if mode in ("ddp", "hsdp"):
        opt: Any = torch.optim.Adam(model.parameters(), lr=0.05)
        sched: Any = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = None
    skip_opt = plan.get("skip_optimizer", False)

    def state_dict() -> dict[str, Any]:
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        if sched is not None and plan.get("scheduler_in_state", True):
            sd["sched"] = sched.state_dict()
        return {**sd, "seen": SEEN["batches"]}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        if not skip_opt:
            opt.load_state_dict(sd["optim"])
        if "sched" in sd:
            sched.load_state_dict(sd["sched"])
        if not plan.get("forget_seen"):
            SEEN["batches"] = sd["seen"]

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1 if plan.get("spares") else plan["min_replicas"],
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica{plan['index']}",
        store_addr="127.0.0.1",
        store_port=box.value,
        rank=rank,
        world_size=plan["group_size"],
        lighthouse_addr=plan["lighthouse"],
        # HSDP: the source reads its FSDP2 state_dict in the quorum thread; a synchronous quorum keeps that
        # off the forward pass (an unsharded parameter freed under autograd otherwise, now and then).
        use_async_quorum=mode not in ("diloco", "hsdp"),
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        world_size_mode=WorldSizeMode.FIXED_WITH_SPARES if plan.get("spares") else WorldSizeMode.DYNAMIC,
    )
    gen = torch.Generator().manual_seed(1000 * plan["index"] + 10 * rank + plan.get("attempt", 0))
    if plan.get("attempt", 0) == 0:  # every group's first run starts together: they all form the first quorum
        START.wait(30)
    audit_kw = dict(
        timeout_s=plan.get("timeout_s", 5.0),
        verbose=False,
        every_n_steps=plan.get("every", 2),
        on_mismatch=plan.get("on_mismatch", "warn"),
        report_path=plan["report"].format(**plan) if plan.get("report") else None,
        **plan.get("options", {}),
    )
    raised = None
    try:
        if mode in ("ddp", "hsdp"):
            records = _ddp_loop(plan, manager, model, opt, sched, gen, snapshots, audit_kw, TorchFTAudit)
        else:
            records = _sync_loop(plan, manager, model, opt, gen, snapshots, audit_kw, TorchFTAudit)
    except WeightDivergenceError as exc:  # on_mismatch="raise": out of the optimizer step, with the record
        records, raised = [], exc.result.to_dict()
    finally:
        manager.shutdown(wait=False)
    out = {"records": records, "snapshots": snapshots, "step": manager.current_step(), "raised": raised}
    return {**out, "step_s": STEP_S, "summary": SUMMARY[0] if SUMMARY else None, "groups": GROUPS[0] if GROUPS else 0}


def _ddp_loop(plan, manager, model, opt, sched, gen, snapshots, audit_kw, TorchFTAudit) -> list[dict[str, Any]]:
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    hsdp = plan["mode"] == "hsdp"
    ddp = model if hsdp else DistributedDataParallel(manager, model)
    wrapped = OptimizerWrapper(manager, opt)
    # The truth: the state each audit point sees, taken by a hook registered (and so run) before the audit's
    # (not in benchmarks, ``truth=False``: a copy of the whole state every step is no training loop's).
    if plan.get("truth", True):
        opt.register_step_pre_hook(
            lambda o, a, k: snapshots.__setitem__(manager.current_step() - 1, _state(model, opt, sched))
        )

    def make_audit() -> Any:
        return (TorchFTAudit if plan.get("audit", True) else _NoAudit)(
            manager,
            ddp,
            wrapped,
            lr_scheduler=sched,
            must_match={"batches_seen": lambda: SEEN["batches"]},  # the user's own counter, declared
            per_replica=("dataloader position",),
            **audit_kw,
        )

    late = plan.get("audit_from")  # this replica's audit made only at this step: it saw none of the quorums before
    audit = make_audit() if late is None else _NoAudit()
    stepped: dict[int, bool] = {}

    def committed(o: Any, a: Any, k: Any) -> None:  # runs only when the optimizer stepped: a committed step
        stepped[0] = True
        SEEN["batches"] += 1

    opt.register_step_post_hook(committed)
    while manager.current_step() < plan["steps"]:
        if late is not None and isinstance(audit, _NoAudit) and manager.current_step() >= late:
            audit = make_audit()
        wrapped.zero_grad()
        t0, before = time.perf_counter(), manager.current_step()
        x = torch.randn(8, model[0].in_features, generator=gen)
        ddp(x).pow(2).mean().backward()
        if hsdp:  # FSDP2 reduced the gradients within the group; torchft averages each shard across groups
            for work in [manager.allreduce(p.grad.to_local()) for p in model.parameters()]:
                work.wait()
        wrapped.step()
        if stepped.pop(0, False):  # the schedule follows committed steps only (a heal moves the Manager's step)
            sched.step()
        nudge = plan.get("nudge")  # (group rank, step): one weight moved on that rank only, after that step
        if nudge is not None and (plan["rank"], manager.current_step()) == tuple(nudge):
            with torch.no_grad():  # this process's own bytes (an FSDP shard's: a DTensor op would be collective)
                _mine(model[0].weight)[0, 0] += 1e-3
        if plan.get("die_at") is not None and manager.current_step() == plan["die_at"]:
            os.kill(os.getpid(), signal.SIGKILL)
        STEP_S.append((before, time.perf_counter() - t0))
        time.sleep(plan.get("pause_s", 0.0))
    channel = getattr(getattr(audit, "auditor", None), "channel", None)
    GROUPS.append(len(channel.pgs) if channel is not None else 0)
    audit.close()
    SUMMARY.append(audit.summary() if hasattr(audit, "summary") else None)
    return [r.to_dict() for r in audit.results]


def _sync_loop(plan, manager, model, opt, gen, snapshots, audit_kw, TorchFTAudit) -> list[dict[str, Any]]:
    from torchft.local_sgd import DiLoCo, LocalSGD

    if plan["mode"] == "localsgd":
        sync: Any = LocalSGD(manager, model, opt, sync_every=plan["sync_every"])
    else:
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        sync = DiLoCo(manager, [model], opt, outer, sync_every=plan["sync_every"])
    fault = plan.get("sync_fault")  # {sync, param, element, bit}: this replica's all-reduced bytes, flipped there
    if fault is not None:
        average, calls = sync._average, [0]

        def faulty_average() -> list[torch.Tensor]:  # LocalSGD copies what it returns into the model
            out, calls[0] = average(), calls[0] + 1
            if calls[0] == fault["sync"]:
                out[fault["param"]].view(-1).view(torch.int32)[fault["element"]] ^= 1 << fault["bit"]
            return out

        sync._average = faulty_average
    local = [0]
    with sync:
        audit = TorchFTAudit(manager, sync=sync, **audit_kw)

        def after_local_step(o: Any, a: Any, k: Any) -> None:  # registered after LocalSGD's: sees the sync done
            local[0] += 1
            snapshots[local[0]] = {**_state(model, None, None), "manager_step": manager.current_step()}

        opt.register_step_post_hook(after_local_step)
        manager.start_quorum()  # the first quorum (LocalSGD's examples do this too)
        while local[0] < plan["steps"]:
            opt.zero_grad()
            model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
            opt.step()
        audit.close()
    return [r.to_dict() for r in audit.results]


class _NoAudit:
    """No audit (a benchmark's baseline loop)."""

    results: list[Any] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


STEP_S: list[tuple[int, float]] = []
"""Each iteration of the DDP loop in this process (benchmarks): the Manager's step it began at, its seconds."""

SUMMARY: list[str | None] = []
"""The audit's closing summary in this process (the DDP loop's)."""

GROUPS: list[int] = []
"""The gloo groups the audit's channel held at the end in this process (the DDP loop's)."""

SEEN = {"batches": 0}
"""The user's own counter of committed batches (in its state_dict; declared to the audit with must_match)."""

START: Any = None
"""A barrier every process of a job's first run meets at before training (set by :func:`run_job`, forked)."""


def run_job(
    replicas: list[Replica],
    *,
    mode: str = "ddp",
    steps: int,
    deadline_s: float = 90.0,
    min_replicas: int | None = None,
    **common: Any,
) -> dict[tuple[int, int], dict[str, Any]]:
    """Run the replica groups to the end (a killed group started again once, unless it left); results by
    (replica, rank). ``min_replicas``: the lighthouse's and every Manager's (default: every group)."""
    least = len(replicas) if min_replicas is None else min_replicas
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    global START
    START = ctx.Barrier(sum(r.group_size for r in replicas))
    results: dict[tuple[int, int], dict[str, Any]] = {}
    procs: dict[tuple[int, int], Any] = {}
    boxes: list[Any] = []
    with lighthouse(least) as address:

        def start(rep: Replica, attempt: int) -> None:
            port = ctx.Value("i", 0)  # set by the group's rank 0; kept here (Process.start drops its args)
            boxes.append(port)
            for rank in range(rep.group_size):
                plan = dict(common, **rep.extra, index=rep.index, rank=rank, group_size=rep.group_size, mode=mode,
                            steps=steps, port_box=port, lighthouse=address, min_replicas=least,
                            attempt=attempt)  # fmt: skip
                if attempt == 0:
                    plan["die_at"] = rep.die_at
                else:
                    plan.update(rep.restarted or {})
                p = ctx.Process(target=worker, args=(plan, q), daemon=True)
                p.start()
                procs[(rep.index, rank)] = p

        for rep in replicas:
            start(rep, 0)
        restarted: set[int] = set()
        end = time.monotonic() + deadline_s
        want = sum(r.group_size for r in replicas if r.restarted is not None or r.die_at is None)
        try:
            while len(results) < want:
                if time.monotonic() > end:
                    raise AssertionError(f"the torchft job did not finish in {deadline_s}s; done: {sorted(results)}")
                for rep in replicas:
                    dead = [procs[(rep.index, r)] for r in range(rep.group_size)]
                    if rep.die_at is not None and rep.index not in restarted and any(p.exitcode for p in dead):
                        for p in dead:
                            p.kill()
                            p.join()
                        restarted.add(rep.index)
                        if rep.restarted is not None:
                            start(rep, 1)
                try:
                    status, index, rank, payload = q.get(timeout=0.2)
                except queue.Empty:
                    continue
                if status == "err":  # the others' errors too: the first to report is often not the cause
                    errors = [f"replica {index} rank {rank} raised: {payload}"]
                    with contextlib.suppress(queue.Empty):
                        while len(errors) < want:
                            more = q.get(timeout=2.0)
                            if more[0] == "err":
                                errors.append(f"replica {more[1]} rank {more[2]} raised: {more[3]}")
                    raise AssertionError("\n\n".join(errors))
                results[(index, rank)] = pickle.loads(payload)
        finally:
            for p in procs.values():
                if p.is_alive():
                    p.kill()
                p.join(5)
    return results
