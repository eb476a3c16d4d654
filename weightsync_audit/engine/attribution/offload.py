"""The at-rest digests off the training thread (with ``overlap=True``): :class:`RestReader`.

Synchronously, the at-rest check reads the parameters and optimizer state twice per step on the training
thread: right after the step and right before the next. With ``overlap`` the audit already leaves the
window between two steps to a worker thread; the at-rest reads go there too, on a thread of their own:

- **right after the step** the training thread only checks the cached structure, hashes the small tensors
  (as the audit's launch does) and stamps every tensor's version counter (an integer each); the worker
  reads the rest at once, while the next forward and backward run;
- **later in the window** the worker reads everything again, twice, timed from the last steps: at half the
  shortest of the last 8 windows, and again to end just before the next step's pre-step hook (that
  shortest window less one and a half reads); the hook does not wait for them: the latest read complete
  by then is the one compared, one still running is dropped, never compared half-written;
- **at the pre-step hook** the training thread compares the version counters again, and re-digests only
  the tensors whose counter moved.

So a write through torch anywhere in the window is seen exactly (its counter); a change that moves no
counter (a bit flip, a write through ``.data`` or a raw pointer) is seen when it lands between the two
reads: not in the time of one read right after the step, nor after the late read began, but for the
parameters the update replay copies that step (their pre-step copies are digested on the collective
check's worker against the post-step read: ``AtRest.copy_check``). A post-step read during which a counter
moved (a write racing it) leaves the step's ``post`` word unknown, and what it raced changed at rest. The
audit still finds what the check misses; its blame is then the vote's, or undecided. On the training thread
this costs the structure check, the small tensors and the counters; the reads use a core of their own where
one is free (benchmarks/bench_attribution.py).

(The collective check's digests go to a :class:`~weightsync_audit.channel.store.Worker` of their own:
:class:`~weightsync_audit.engine.attribution.replay.ReducedDigests`.)
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from typing import Callable, Sequence

import numpy as np

from weightsync_audit.channel.store import Worker
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest

__all__ = ["RestReader"]

MARGIN = 1.5
"""The late read starts this many read-lengths before the window's predicted end."""
WINDOWS = 8
"""Windows whose shortest predicts the next one's end."""


def _ema(old: float | None, new: float) -> float:
    return new if old is None else 0.7 * old + 0.3 * new


class _Window:
    """One window between two steps: what was prepared after the step, and what the worker read."""

    def __init__(
        self,
        prepared: PreparedManifest,
        keep: Sequence[int],
        method: str,
        stamp: Callable[[], np.ndarray] | None = None,
        stamped: np.ndarray | None = None,
    ) -> None:
        self.prepared, self.keep, self.method = prepared, list(keep), method
        self.t_post = time.perf_counter()
        self.stamp = stamp
        """Every manifest tensor's version counters now (read on the worker right after its post read)."""
        self.stamped = stamped[self.keep] if stamped is not None and stamp is not None else None
        self.raced: np.ndarray | None = None
        """Which tensors a write through torch reached before the post-step read ended (a counter moved): their
        bytes may be some before and some after the write, so the step's ``post`` word is unknown, not wrong."""
        self.post: np.ndarray | None = None
        self.late: np.ndarray | None = None
        self.error: BaseException | None = None
        self.post_done = threading.Event()
        self.abort = threading.Event()
        self.lock = threading.Lock()

    def read(self, fresh: bool) -> np.ndarray:
        prepared = dataclasses.replace(self.prepared, in_place=None) if fresh else self.prepared
        return prepared.digests(method=self.method)[self.keep]


class RestReader:
    """The worker thread of one watch, and the window under way."""

    def __init__(self, method: str = "auto") -> None:
        self.method = method
        self.windows: deque[float] = deque(maxlen=WINDOWS)
        """The last windows' lengths: from a step's end to the next step's pre-step hook."""
        self.read_s: float | None = None
        """One full read (moving average)."""
        self.late_reads = 0
        """Windows with a read complete before the next step besides the post-step one (the check covered them)."""
        self._worker: Worker | None = None
        self._window: _Window | None = None

    def launch(
        self,
        prepared: PreparedManifest,
        keep: Sequence[int],
        stamp: Callable[[], np.ndarray] | None = None,
        stamped: np.ndarray | None = None,
    ) -> None:
        """Right after a step, on the training thread: the worker reads ``prepared``'s ``keep`` positions."""
        if self._worker is None:
            self._worker = Worker("weightsync-audit-at-rest")
        w = self._window = _Window(prepared, keep, self.method, stamp, stamped)
        self._worker.submit(lambda: self._read(w))

    def post(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The post-step read of the window under way, waiting for it if need be (None: none, or it failed), and
        which of its tensors a write through torch reached before it ended (None: not known)."""
        w = self._window
        if w is None:
            return None, None
        w.post_done.wait()
        if w.error is not None:
            raise w.error
        return w.post, w.raced

    def collect(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """At the pre-step hook, on the training thread: the window's post read (waited for: the step must not
        write under it) and its late read when it was complete (else None); the window is closed."""
        w = self._window
        if w is None:
            return None, None
        with w.lock:
            w.abort.set()
            late = w.late
        post, _ = self.post()
        self._window = None
        self.windows.append(time.perf_counter() - w.t_post)
        self.late_reads += late is not None
        return post, late

    def _read(self, w: _Window) -> None:  # on the worker
        try:
            t0 = time.perf_counter()
            w.post = w.read(fresh=False)
            if w.stamp is not None and w.stamped is not None:
                w.raced = w.stamp()[w.keep] != w.stamped
            self.read_s = _ema(self.read_s, time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            w.error = exc
        finally:
            w.post_done.set()
        windows = list(self.windows)
        if w.error is not None or not windows or self.read_s is None:
            return  # the first window: no length known yet (the counters still see every torch write)
        shortest = min(windows)
        for at in (shortest / 2, shortest - MARGIN * self.read_s):
            if w.abort.wait(timeout=max(0.0, w.t_post + at - time.perf_counter())):
                break
            try:
                late = w.read(fresh=True)
            except Exception:  # noqa: BLE001 - a read that failed covers nothing; the counters still do
                break
            with w.lock:
                if w.abort.is_set():
                    break
                w.late = late

    def close(self) -> None:
        """End the worker thread (the window under way is dropped)."""
        if self._window is not None:
            self._window.abort.set()
            self._window = None
        if self._worker is not None:
            self._worker.close()
            self._worker = None
