"""Real multi-process gloo groups for tests: fork, one process per rank, results back by queue."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Collection, NoReturn


class RankFailed(AssertionError):
    """A rank raised; the message carries its traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n{tb}")


class InitFailed(RankFailed):
    """A rank's ``init_process_group`` failed, before the function under test ran: the harness's trouble."""


INIT_TRIES = 3
"""How many times :func:`run_ranks` starts a job whose process group could not form. Its gloo pairs listen on
ports the kernel hands out, in the range a concurrent test's launcher (Lightning's, Ray Train's) picks its own
port from by bind-then-close; when that launcher's ranks connect to the number a pair listener took in between,
the mesh fails ("Gloo connectFullMesh failed ... Connection closed by peer", once in a CI run)."""


class RankDied:
    """Stands in the results for a rank listed in ``may_die`` that never reported (e.g. SIGKILLed)."""

    def __init__(self, rank: int, exitcode: int | None = None) -> None:
        self.rank = rank
        self.exitcode = exitcode
        """The process's exit status (negative: the signal that ended it); ``None`` if unknown."""

    def __repr__(self) -> str:
        return f"RankDied({self.rank})"


_NEXT_PORT: list[int] = []
_SLOT_LOCK: list[Any] = []
SLOTS = 48
"""Slices of 400 ports from 12000: 12000-31199, below the kernel's ephemeral range."""


def _port_slot() -> int:
    """The first slice no other live process holds (a lock file each, held for this process's life): two
    suites on one host (two worktrees, a helper's and yours) never walk the same ports."""
    import fcntl
    import tempfile

    for slot in range(SLOTS):
        f = open(os.path.join(tempfile.gettempdir(), f"weightsync-test-ports-{slot}.lock"), "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        _SLOT_LOCK.append(f)
        return slot
    raise RuntimeError(f"all {SLOTS} port slices are held by other processes")


def free_port() -> int:
    """A port for a rendezvous, below the kernel's ephemeral range and in a slice of its own per test process.

    ``bind(0)`` then close leaves a window in which a connection's ephemeral port, or another pytest worker's
    ``bind(0)``, may take the same number; ports below 32768 are never handed out that way, and each process
    (an xdist worker, a plain run, another suite's) walks its own slice of 400 ports (:func:`_port_slot`).
    """
    if not _NEXT_PORT:
        _NEXT_PORT.append(12000 + _port_slot() * 400)
    for _ in range(400):
        port = _NEXT_PORT[0]
        _NEXT_PORT[0] = port + 1 if (port + 1 - 12000) % 400 else port - 399
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in this process's slice")


def join_group(rank: int, world: int, port: int, timeout_s: float) -> None:
    """This forked rank's default gloo group, met at ``127.0.0.1:port``, one torch thread (the ranks share 2 cores)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def _entry(
    fn: Callable[..., Any], rank: int, world: int, port: int, q: Any, args: tuple, kwargs: dict, pg_timeout_s: float
) -> None:
    import torch.distributed as dist

    try:
        try:
            join_group(rank, world, port, pg_timeout_s)
        except BaseException as exc:  # noqa: BLE001 - the harness's own set-up, before any code under test
            q.put(("init", rank, (type(exc).__name__, str(exc), traceback.format_exc())))
            return
        _HELD.append((dist.distributed_c10d._get_default_store(), rank, world))
        out = fn(rank, world, *args, **kwargs)
        # Pickled here, by value: torch's queue reducers would pass tensors as file descriptors that the
        # parent fetches from this process, which may have exited by then ("Connection reset by peer").
        q.put(("ok", rank, pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("err", rank, (type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        leave(q)


_HELD: list[tuple[Any, int, int]] = []
"""In a rank :func:`start_ranks` forked: the job's store, the rank and the world, once the group formed."""


def leave(q: Any) -> NoReturn:
    """A forked rank's end: ``q`` flushed, its audit groups forgotten, its process group destroyed, exit 0.

    The job's store lives in rank 0, which therefore leaves last: a rank still making groups through the store
    when rank 0 was done with its own (torchtitan's meshes, in which rank 0 has less to make) lost the store
    under it once ("recvValueWithTimeout failed ... Connection reset by peer") and never reported.
    """
    import torch.distributed as dist

    # The queue's feeder thread must flush the result before os._exit, which would kill it mid-write.
    q.close()
    q.join_thread()
    try:
        from weightsync_audit.channel.star import forget_groups

        forget_groups()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    if _HELD:
        store, rank, world = _HELD[0]
        try:
            store.add("ranks/left", 1)
            deadline = time.monotonic() + 60
            while rank == 0 and store.add("ranks/left", 0) < world and time.monotonic() < deadline:
                time.sleep(0.005)  # a rank that died never says it left: collect_ranks ends this wait
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
            pass
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world: int = 2,
    *args: Any,
    timeout: float = 90,
    expect_errors: bool = False,
    may_die: Collection[int] = (),
    pg_timeout_s: float = 60,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks; return each rank's result.

    With ``expect_errors`` a raising rank yields a ``RankFailed`` in its slot instead of failing the test.
    A rank in ``may_die`` that exits without reporting (killed on purpose) yields a ``RankDied``.
    Any other rank that neither returns nor raises within ``timeout`` fails the test (a hang is a bug).
    ``pg_timeout_s`` is the process group's own timeout (benchmarks of large models need more).
    """
    started = start_ranks(fn, world, *args, pg_timeout_s=pg_timeout_s, **kwargs)
    return collect_ranks(started, timeout=timeout, expect_errors=expect_errors, may_die=may_die)


@dataclass(slots=True)
class Job:
    """Ranks :func:`start_ranks` started: their processes, their queue, and how to start them again."""

    world: int
    procs: list[Any]
    q: Any
    again: Callable[[], Job]
    """The same job started afresh, on another port (:data:`INIT_TRIES`)."""


def start_ranks(fn: Callable[..., Any], world: int = 2, *args: Any, pg_timeout_s: float = 60, **kwargs: Any) -> Job:
    """:func:`run_ranks`' ranks, started (a job of its own: its port, its store); :func:`collect_ranks` waits for
    them. Jobs started one after the other from one thread run side by side (tests that mostly wait on deadlines)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, q, args, kwargs, pg_timeout_s), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return Job(world, procs, q, lambda: start_ranks(fn, world, *args, pg_timeout_s=pg_timeout_s, **kwargs))


def collect_ranks(
    job: Job, timeout: float = 90, expect_errors: bool = False, may_die: Collection[int] = ()
) -> list[Any]:
    """What the ranks :func:`start_ranks` started return, as :func:`run_ranks` gives it; a job whose process group
    could not form is started again, at most :data:`INIT_TRIES` times in all, each try with ``timeout`` of its own."""
    for attempt in range(1, INIT_TRIES):
        try:
            return _collect(job, timeout, expect_errors, may_die)
        except InitFailed as exc:
            print(f"tests/ranks.py: the process group did not form (try {attempt}): {exc.message}", file=sys.stderr)
            job = job.again()
    return _collect(job, timeout, expect_errors, may_die)  # the last try: its InitFailed is the test's


def _collect(job: Job, timeout: float, expect_errors: bool, may_die: Collection[int]) -> list[Any]:
    world, procs, q = job.world, job.procs, job.q
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            if may_die and all(r in results or r in may_die for r in range(world)):
                # The survivors have reported; a rank allowed to die gets a moment to report too.
                if all(not procs[r].is_alive() for r in may_die if r not in results) and q.empty():
                    break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                status, rank, payload = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
                continue
            if status == "init":
                raise InitFailed(rank, *payload)  # the others are killed below: their group cannot form either
            results[rank] = pickle.loads(payload) if status == "ok" else RankFailed(rank, *payload)
    except InitFailed:
        for p in procs:  # the others wait on a group that cannot form
            p.kill()
        raise
    finally:
        for p in procs[1:]:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        # Rank 0 leaves once every other rank has said it left (leave()); one that died never says so.
        procs[0].join(timeout=0.5 if 0 in results else 2)
        if procs[0].is_alive():
            procs[0].kill()
            procs[0].join()
    for r in may_die:
        if r not in results:
            results[r] = RankDied(r, procs[r].exitcode)
    missing = [r for r in range(world) if r not in results]
    if missing:
        raise AssertionError(f"ranks {missing} did not finish within {timeout}s (hang or crash)")
    out = [results[r] for r in range(world)]
    if not expect_errors:
        for r in out:
            if isinstance(r, RankFailed):
                raise r
    return out
