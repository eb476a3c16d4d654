"""The audit channel's link to the job's key-value store, every call bounded in time.

The store is where failure verdicts go when gloo cannot carry them (a timed-out gloo wait closes every
pair of its context). In a standard launch the store is served from global rank 0's process; when that
process is stopped (SIGSTOP, a debugger, swapped out), a TCPStore client blocks in *every* call, even
``wait`` with a timeout and after ``set_timeout`` (measured, torch 2.13: ``check`` and ``wait`` on a
stopped server never return). So each call here runs in a daemon thread and is abandoned after its
bound; after one abandoned call the link is dead and later calls fail at once, so no rank ever waits on
the store past ``timeout_s`` + grace, wherever the store lives.

The link uses the job's own client connection: a call left blocked on a stopped server only waits where
any other call to that server would wait too. (A second client per rank was tried and dropped: 32 ranks
connecting at once took 5 s on 2 cores.)

Every such call runs on a :class:`Worker`: one daemon thread that runs the calls handed to it in order, the
one worker of the package (an overlapped audit's and attribution's reads and digests run on one too).
"""

from __future__ import annotations

import os
import queue
import threading
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.distributed as dist

__all__ = ["Call", "StoreLink", "StoreUnreachable", "Worker", "run_bounded"]

T = TypeVar("T")


JOIN_S = 10.0
"""How long closing a :class:`Worker` waits for its thread to end."""


class Call:
    """One call handed to a :class:`Worker`: ``done`` once it ran, ``outcome`` then ``(True, its value)`` or
    ``(False, what it raised)``."""

    __slots__ = ("done", "fn", "outcome")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn: Callable[[], Any] | None = fn
        self.done = threading.Event()
        self.outcome: tuple[bool, Any] = (False, None)


class Worker:
    """One daemon thread that runs the calls handed to it, in order: the bounded store calls (kept between
    calls: starting a thread per call costs a hand-off more, 0.3-1 ms on busy cores), an overlapped audit,
    attribution's reads and digests. What a call raises is kept in its :class:`Call`, never escapes."""

    def __init__(self, name: str) -> None:
        self.inbox: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self.last: Call | None = None
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], Any]) -> Call:
        """Run ``fn`` on the thread, after the calls handed to it before."""
        self.last = Call(fn)
        self.inbox.put(self.last)
        return self.last

    def drain(self) -> None:
        """Wait until every call handed to the thread so far has run (never from a call itself)."""
        if self.last is not None:
            self.last.done.wait()

    def _serve(self) -> None:
        while (call := self.inbox.get()) is not None:
            fn, call.fn = call.fn, None  # nothing it holds outlives the call
            try:
                call.outcome = (True, fn())  # type: ignore[misc]
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                call.outcome = (False, exc)
            call.done.set()

    def close(self, join_s: float = JOIN_S) -> None:
        """End the thread once the calls handed to it have run, waiting at most ``join_s`` (0: not at all)."""
        self.inbox.put(None)
        if join_s:
            self.thread.join(timeout=join_s)  # ended before the interpreter is, never half-way


_idle: list[Worker] = []  # kept for bounded calls; one whose call missed its bound is dropped
_idle_pid: list[int] = []
_idle_lock = threading.Lock()


def run_bounded(fn: Callable[[], T], bound_s: float, name: str) -> tuple[bool, Any] | None:
    """``fn()`` on a kept daemon thread (named ``name`` when it is started), waited for at most ``bound_s``:
    ``(True, its value)``, ``(False, what it raised)``, or ``None`` when it did not finish (the thread is
    left to end on its own, and is not used again).

    >>> run_bounded(lambda: 7, 1.0, "demo")
    (True, 7)
    """
    with _idle_lock:
        if _idle_pid != [os.getpid()]:  # the parent's runners did not survive the fork
            _idle.clear()
            _idle_pid[:] = [os.getpid()]
        runner = _idle.pop() if _idle else Worker(name)
    call = runner.submit(fn)
    if not call.done.wait(max(bound_s, 0.01)):
        runner.close(join_s=0)  # it ends that call on its own, then exits
        return None
    with _idle_lock:
        _idle.append(runner)
    return call.outcome


class StoreUnreachable(Exception):
    """The store did not answer within the bound (its host is stopped or gone) or raised."""


class StoreLink:
    """Bounded calls into a prefixed view of the job's store.

    >>> link = StoreLink(dist.HashStore(), "demo")
    >>> link.call(lambda s: s.set("k", "v"), 1.0); link.call(lambda s: s.get("k"), 1.0)
    b'v'
    """

    def __init__(self, store: Any, prefix: str) -> None:
        self.store = dist.PrefixStore(prefix, store)
        self.dead: str | None = None

    def call(self, fn: Callable[[Any], T], bound_s: float) -> T:
        """``fn(store)`` within ``bound_s`` seconds, else :class:`StoreUnreachable`."""
        if self.dead:
            raise StoreUnreachable(self.dead)
        outcome = run_bounded(lambda: fn(self.store), bound_s, "weightsync-store")
        if outcome is None:
            self.dead = f"the job's store did not answer within {bound_s:.3g}s (its host is stopped or gone)"
            raise StoreUnreachable(self.dead)
        ok, value = outcome
        if not ok:
            raise StoreUnreachable(str(value).strip().splitlines()[-1][:200] if str(value).strip() else "store error")
        return value

    def set(self, key: str, value: str, bound_s: float = 2.0) -> bool:
        """Best effort: whether the value was written."""
        try:
            self.call(lambda s: s.set(key, value), bound_s)
            return True
        except StoreUnreachable:
            return False

    def wait_get(self, key: str, wait_s: float, bound_s: float) -> bytes | None:
        """The key's value once it exists (waiting up to ``wait_s``), else ``None``; ``bound_s`` overall."""

        def fetch(s: Any) -> bytes:
            s.wait([key], timedelta(seconds=max(wait_s, 0.001)))
            return s.get(key)

        try:
            return self.call(fetch, bound_s)
        except StoreUnreachable:
            return None
