"""The audit's channel among torchft replica groups: the library's star over a gloo group of the quorum.

Each replica group is its own job (its own ``torch.distributed`` world, or none), so the library's channel
over the job's process group cannot reach the other replicas. What every member of a quorum does reach is
the store torchft's own process group meets in (the quorum's ``store_address``). :class:`QuorumComm` is
the library's :class:`~weightsync_audit.channel.star.Comm` over a gloo group of its own, made in that store
under a prefix unique to one audit (quorum, group rank, audit point, step) among the members that came to
it (:mod:`~weightsync_audit.integrations.torchft.rollcall`): every phase of the audit, the data plane
included, runs over it unchanged, and every wait keeps its deadline. torchft's training process group is
never used: a timed-out gloo wait closes every connection of its group, which must never be torchft's.

Members are identified by their replica rank in the quorum; the position order (who coordinates, who wins
a tie) is the roll's.

>>> QuorumComm((3,), 0, None, "demo", 5.0).distributed
False
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Hashable, TypeVar

import torch.distributed as dist

from weightsync_audit.channel.dataplane import DataPlane
from weightsync_audit.channel.groups import AuditGroup, StoreLink, run_bounded
from weightsync_audit.channel.star import DEFAULT_GRACE_S, Comm
from weightsync_audit.errors import AuditTimeoutError

__all__ = ["QuorumComm", "drop_store", "quorum_store", "within"]

T = TypeVar("T")

_TAG = 0x5A17
"""The tag of every point-to-point message on a quorum channel's groups."""

_stores: dict[str, Any] = {}
_stores_lock = threading.Lock()


def within(fn: Callable[[], T], bound_s: float, what: str) -> T:
    """``fn()`` in a helper thread, given up after ``bound_s`` (:class:`AuditTimeoutError` naming ``what``).

    A thread left waiting (a TCP connect, a gloo group whose peer vanished) ends with its own timeout."""
    outcome = run_bounded(fn, bound_s, "weightsync-torchft")
    if outcome is None:
        raise AuditTimeoutError(f"weightsync audit: {what} did not finish within {bound_s:.3g}s")
    ok, value = outcome
    if not ok:
        raise AuditTimeoutError(f"weightsync audit: {what} failed: {str(value).strip()[:300] or type(value).__name__}")
    return value


def quorum_store(address: str, bound_s: float) -> Any:
    """A client of the quorum's store at ``host:port`` (kept per address), connected within ``bound_s``."""
    with _stores_lock:
        store = _stores.get(address)
    if store is not None:
        return store
    host, _, port = address.partition("/")[0].rpartition(":")
    store = within(
        lambda: dist.TCPStore(
            host.strip("[]"), int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=bound_s)
        ),
        bound_s,
        f"connecting to the quorum's store at {address}",
    )
    with _stores_lock:
        return _stores.setdefault(address, store)


def drop_store(address: str) -> None:
    """Forget the client of the store at ``address`` (after a failure: the next audit connects afresh)."""
    with _stores_lock:
        _stores.pop(address, None)


class QuorumComm(Comm):
    """The star over ``members`` (replica ranks, in position order), this process at ``position``.

    ``store`` is the quorum's store, ``prefix`` this audit's place in it; groups are made on first use
    (:meth:`open_members`, :meth:`side_group`) and released by :meth:`close`.
    """

    def __init__(
        self,
        members: tuple[int, ...],
        position: int,
        store: Any,
        prefix: str,
        timeout_s: float,
        grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        self.members = tuple(members)
        self.position = position
        self.store = store
        self.prefix = prefix
        self.pgs: list[Any] = []
        """Every gloo group of this channel (the star's and the data plane's), released by :meth:`close`."""
        super().__init__(None, timeout_s, grace_s)

    @property
    def whole(self) -> bool:
        """No exchange over it has failed: every member that also says so can use it again."""
        return self._group is None or not self._group.broken

    def membership(self, group: Any) -> tuple[int, int, tuple[int, ...]]:
        return len(self.members), self.position, self.members

    def _gloo(self, suffix: str) -> Any:
        """A gloo group of the members under ``prefix/suffix``, every pair connected within the deadline."""
        store = dist.PrefixStore(f"{self.prefix}/{suffix}", self.store)
        limit = self._deadline_s() + self.grace_s
        pg = within(
            lambda: dist.ProcessGroupGloo(store, self.position, self.world_size, timedelta(seconds=limit)),
            limit,
            f"opening the audit channel among replicas {list(self.members)} ({suffix})",
        )
        self.pgs.append(pg)
        return pg

    def open_members(self) -> AuditGroup:
        pg = self._gloo("star")
        return AuditGroup(pg, self.members, StoreLink(self.store, f"{self.prefix}/verdicts"))

    def post(self, pg: Any, t: Any, peer: int, send: bool) -> Any:
        return pg.send([t], peer, _TAG) if send else pg.recv([t], peer, _TAG)

    def side_group(self, name: str, timeout: timedelta) -> Any:
        # Counted per channel: every member opens its side groups at the same points of one audit.
        return self._gloo(f"side{len(self.pgs)}")

    def side_key(self) -> Hashable:
        return ("torchft", self.prefix)

    def close(self) -> None:
        """Release the channel's groups; later exchanges over it fail at once."""
        if self._group is not None:
            self._group.broken = self._group.broken or "the audit's channel was closed after the audit"
        DataPlane(self).close()
        self.pgs.clear()
