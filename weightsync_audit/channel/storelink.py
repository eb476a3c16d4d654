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
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.distributed as dist

__all__ = ["StoreLink", "StoreUnreachable", "run_bounded"]

T = TypeVar("T")


def run_bounded(fn: Callable[[], T], bound_s: float, name: str) -> tuple[bool, Any] | None:
    """``fn()`` in a daemon thread named ``name``, waited for at most ``bound_s``: ``(True, its value)``,
    ``(False, what it raised)``, or ``None`` when it did not finish (the thread is left to end on its own).

    >>> run_bounded(lambda: 7, 1.0, "demo")
    (True, 7)
    """
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(max(bound_s, 0.01))
    return box[0] if box else None


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
