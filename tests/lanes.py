"""A lane for the test files that mostly wait, beside the workers that compute (``make test TEST_WORKERS=3``).

With 3 pytest-xdist workers or more, whole files go to the first workers in collection order, as ``--dist
loadfile`` does; the last worker takes only the files of :data:`WAITING`, one after the other. Those spend most
of their time waiting out a deadline (a rank stopped, killed or late; a process given its grace), using a third
of a core or less. Run among the others they left a core idle while they waited (about 90 core-seconds over the
suite, ``vmstat`` beside a per-test CPU probe); on a lane of their own they wait beside two workers that keep
both cores busy: 234-284 s of tests on 2 cores against 330 s (stop 60); 263 s against 279 s back to back
(stop 61). Not the default: the added load made 4 of its first 10 runs fail a test that is sensitive to it (a
port taken between its check and its bind, a torchft replica that missed its quorum, a writer thread starved),
each passing on its own. The ports and the writer were fixed in stop 61; its 9 runs since passed.

The lane never takes a file that computes, so the cores are never shared three ways by work that computes.
When the computing workers have nothing left they take the waiting files too; when the lane has nothing left
it stops. Fewer than 3 workers, or another ``--dist``: xdist's own scheduler, unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling

WAITING = (
    "test_timeouts.py",
    "test_dataplane.py",
    "test_channel_tree.py",
    "test_callback_faults.py",
    "test_channel_faults.py",
    "test_foreign_groups.py",
    "test_launch.py",
    "test_channel_rounds.py",
)
"""Files that mostly wait, run alone (`pytest tests/FILE`, the whole machine's CPU from ``/proc/stat``):
CPU 0.26-0.67 of a core over their wall time, the interpreter's start included (stop 60)."""


def _is_waiting(scope: str) -> bool:
    return scope.rsplit("/", 1)[-1] in WAITING


class LaneScheduling(LoadFileScheduling):
    """``--dist loadfile`` with its last worker kept for :data:`WAITING`'s files."""

    def _is_lane(self, node: Any) -> bool:
        return bool(node.gateway.id == f"gw{self.numnodes - 1}")

    def _next_scope(self, node: Any) -> str | None:
        lane = self._is_lane(node)
        fallback = None
        for scope in self.workqueue:
            if _is_waiting(scope) == lane:
                return scope
            if fallback is None and not lane:
                fallback = scope
        return fallback

    def _assign_work_unit(self, node: Any) -> None:
        scope = self._next_scope(node)
        if scope is None:
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    def _reschedule(self, node: Any) -> None:
        if node.shutting_down:
            return
        if self._next_scope(node) is None:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 2:
            return
        self._assign_work_unit(node)


def make_scheduler(config: pytest.Config, log: Any) -> LaneScheduling | None:
    """The lane scheduler under ``--dist loadfile`` with 3 workers or more; else None (xdist's own)."""
    workers = config.getoption("numprocesses", None)
    if config.getoption("dist", None) != "loadfile" or not isinstance(workers, int) or workers < 3:
        return None
    return LaneScheduling(config, log)
