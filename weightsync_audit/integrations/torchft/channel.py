"""Where replica groups meet for one audit: a roll call in the quorum's store, then, off the healthy path, a
channel over gloo.

Each replica group is its own job (its own ``torch.distributed`` world, or none), so the library's channel
over the job's process group cannot reach the other replicas. What every member of a quorum does reach is
the store torchft's own process group meets in (the quorum's ``store_address``).

**The roll** (:func:`call_roll`). Not every replica group of a quorum reaches a given audit: a group whose
step did not commit, or that died after the quorum formed, never comes, and the roll never waits for it
past its deadline. Each member writes its entry (replica rank and id, whether it healed at this step and
from whom, its step counters, its history, the channel it holds, its audit summary) and counts itself in;
the last of the
quorum to arrive closes the roll with every entry, and otherwise the first member to give up closes it
with those present. Whichever closes it first is what every member acts on: a member that arrives after
the roll closed without it takes no part (its audit reports so; nobody waits for it). Every member reads
the same entries, so each takes the same decisions. Its order is the channel's position order: the source
of a heal first, then the other replicas that did not heal, then those that healed, each by replica rank;
the coordinator is thus a replica that did not heal, and a tie vote goes to the source.

**The channel** (:class:`QuorumComm`): the library's :class:`~weightsync_audit.channel.star.Comm` over the
members. Its first exchange of an audit, the summaries, *is* the roll: each member's summary rides its
entry, and the rule, a pure function of every member's bytes, is computed by each member alike from the
same entries, so a healthy audit is one roll call and sends nothing over gloo. The exchanges that follow
(off the healthy path: localizing, measuring) run over a gloo group of the members, made on first use in
that store under the prefix of the roll that first met them, and used again at the next audits while every
member holds it whole over the same members (the roll says so); every wait keeps its deadline.
torchft's training process group is never used: a timed-out gloo wait closes every connection of its
group, which must never be torchft's.

>>> order([Member(0, "a", healed=True, source=1), Member(1, "b"), Member(2, "c")])
(1, 2, 0)
>>> QuorumComm(None, "demo", 5.0).distributed  # its members are the roll's, at its first exchange
False
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable, Hashable, Sequence, TypeVar

import numpy as np
import torch.distributed as dist

from weightsync_audit.channel.dataplane import DataPlane
from weightsync_audit.channel.groups import AuditGroup
from weightsync_audit.channel.star import DEFAULT_GRACE_S, Comm
from weightsync_audit.channel.store import StoreLink, run_bounded
from weightsync_audit.errors import AuditPreparationError, AuditTimeoutError

__all__ = ["Member", "QuorumComm", "ReadInFull", "Roll", "call_roll", "drop_store", "order", "quorum_store", "within"]


@dataclass(frozen=True)
class Member:
    """One replica group's entry in the roll (JSON in the store)."""

    replica_rank: int
    replica_id: str
    healed: bool = False
    """It healed from a peer at this step (its state was loaded from ``source``)."""
    source: int | None = None
    """The replica it healed from; with ``healed`` false, a heal that a sync has replaced since."""
    counters: dict[str, Any] = field(default_factory=dict)
    """Step counters and declared state, each ``[kind, value]`` (:func:`~.verdict.collect`)."""
    last_in_sync_step: int | None = None
    last_full_sync_step: int | None = None
    channel: str | None = None
    """The audit channel this member holds open and whole (its prefix): reused when every member holds it."""
    summary: str = ""
    """Its first exchange of the audit (the summary), hex: every member decides it from the entries."""
    full: bool = False
    """It read every byte (``coverage``: a quorum change or a heal it saw); members that differ read again."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class Roll:
    """The members of one audit, in position order, and the quorum's replicas that did not come."""

    members: tuple[Member, ...]
    absent: tuple[int, ...]
    position: int | None
    """This process's position, or ``None`` when the roll closed without it."""
    replica_rank: int = -1
    """This process's replica rank."""

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(m.replica_rank for m in self.members)


def order(members: Sequence[Member]) -> tuple[int, ...]:
    """Replica ranks in position order: a heal's source, the other replicas that did not heal, the healed."""
    sources = [m.source for m in sorted(members, key=lambda m: m.replica_rank) if m.healed and m.source is not None]
    present = {m.replica_rank for m in members}
    first = next((s for s in sources if s in present), None)

    def key(m: Member) -> tuple[int, int, int]:
        return (m.replica_rank != first, int(m.healed), m.replica_rank)

    return tuple(m.replica_rank for m in sorted(members, key=key))


def call_roll(store: Any, prefix: str, me: Member, expected: int, wait_s: float, bound_s: float) -> Roll:
    """Meet the quorum's ``expected`` replicas under ``prefix`` in ``store``; at most ``wait_s`` for latecomers.

    Raises :class:`AuditTimeoutError` when the store does not answer within ``bound_s``."""
    view = dist.PrefixStore(prefix, store)
    outcome = run_bounded(lambda: _roll(view, me, expected, wait_s, bound_s), bound_s, "weightsync-torchft")
    if outcome is None or not outcome[0]:
        why = f"not within {bound_s:.3g}s" if outcome is None else str(outcome[1]).strip()[:200]
        raise AuditTimeoutError(
            f"weightsync audit: the quorum's store did not answer while the replicas met for the audit: {why}"
        )
    members = [Member(**entry) for entry in json.loads(outcome[1])]
    by_rank = {m.replica_rank: m for m in members}
    ranked = order(members)
    return Roll(
        members=tuple(by_rank[r] for r in ranked),
        absent=tuple(r for r in range(expected) if r not in by_rank),
        position=ranked.index(me.replica_rank) if me.replica_rank in by_rank else None,
        replica_rank=me.replica_rank,
    )


def _roll(store: Any, me: Member, expected: int, wait_s: float, bound_s: float) -> bytes:
    """The roll's decision: the entries of those it closed with (at most 3 answered store round trips when all
    come; the ``set`` is not answered)."""
    store.set(f"member/{me.replica_rank}", me.to_json())
    if store.add("count", 1) >= expected:  # the last to arrive: every entry is there
        return store.compare_set("decision", "", _entries(store, list(range(expected))))
    try:
        store.set_timeout(timedelta(seconds=max(wait_s, 0.001)))  # this client's, for the get only
        return store.get("decision")  # once it is there: one round trip
    except Exception:  # noqa: BLE001 - DistStoreError on timeout: close the roll with those present
        present = [r for r in range(expected) if store.check([f"member/{r}"])]
        return store.compare_set("decision", "", _entries(store, present))  # or the decision taken first
    finally:
        store.set_timeout(timedelta(seconds=bound_s))


def _entries(store: Any, ranks: list[int]) -> str:
    raw = store.multi_get([f"member/{r}" for r in ranks]) if ranks else []
    return "[" + ",".join(r.decode() for r in raw) + "]"


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


class ReadInFull(Exception):
    """The members of a roll did not all read every byte (one saw a quorum change or a heal the others had seen
    at an audit it missed): every member raises it alike, and the audit is read again in full, under a roll of
    its own."""


class QuorumComm(Comm):
    """The star over the members of one audit, in the roll's position order.

    ``store`` is the quorum's store, ``prefix`` this audit's place in it. ``roll_call`` takes this member's
    summary and returns the roll: the first :meth:`decide` is answered from it, and the members and this
    process's position are the roll's from then on. ``held``: the last audit's channel, whose groups are
    taken over when every member holds it whole over the same members, else released. Groups are made on
    first use (:meth:`open_members`, :meth:`side_group`) and released by :meth:`close`.
    """

    def __init__(
        self,
        store: Any,
        prefix: str,
        timeout_s: float,
        grace_s: float = DEFAULT_GRACE_S,
        *,
        roll_call: Callable[[bytes], Roll] | None = None,
        held: QuorumComm | None = None,
    ) -> None:
        self.members: tuple[int, ...] = ()
        self.position = 0
        self.store = store
        self.prefix = prefix
        self.pgs: list[Any] = []
        """Every gloo group of this channel (the star's and the data plane's), released by :meth:`close`."""
        self.roll_call = roll_call
        self.held = held
        self.roll: Roll | None = None
        """The roll this audit's members came to (set by the first :meth:`decide`)."""
        super().__init__(None, timeout_s, grace_s)

    def decide(self, payload: bytes | np.ndarray, rule: Any, what: str = "the audit") -> bytes:
        """The first exchange: the roll call, carrying this member's bytes; ``rule`` of every member's bytes,
        computed here as on every member (it is a pure function of them). Later ones: the star's."""
        call, self.roll_call = self.roll_call, None
        if call is None:
            return super().decide(payload, rule, what)
        roll = call(payload.tobytes() if isinstance(payload, np.ndarray) else bytes(payload))
        if roll.position is None:
            raise TimeoutError(
                f"this replica ({roll.replica_rank}) reached the audit after the others had closed its roll (they "
                f"waited {self.timeout_s:g}s)"
            )
        self._meet(roll)
        if len({m.full for m in roll.members}) > 1:
            raise ReadInFull(
                f"replicas {[m.replica_rank for m in roll.members if m.full]} read every byte, the others a slice"
            )
        try:
            return rule([bytes.fromhex(m.summary) for m in roll.members])
        except Exception as exc:  # every member fails alike: the same rule over the same bytes
            text = f"weightsync audit: the replicas could not decide {what}: {type(exc).__name__}: {exc}"
            raise AuditPreparationError(text, {self.global_ranks[0]: text}) from exc

    def _meet(self, roll: Roll) -> None:
        """The roll's members from now on; the held channel's groups taken over when every member holds it
        whole over the same members (a decision every member takes alike, from the roll), else released."""
        held, self.held, self.roll = self.held, None, roll
        assert roll.position is not None
        same = held is not None and held.members == roll.ranks and all(m.channel == held.prefix for m in roll.members)
        self.members, self.position = roll.ranks, roll.position
        Comm.__init__(self, None, self.timeout_s, self.grace_s)
        if held is not None and same:
            self.store, self.prefix, self.pgs, self._group = held.store, held.prefix, held.pgs, held._group
        elif held is not None:
            held.close()

    def setup(self) -> None:
        if self.roll_call is not None:
            raise RuntimeError("weightsync audit: the quorum channel's first exchange must be the roll call")
        super().setup()

    @property
    def whole(self) -> bool:
        """No exchange over it has failed: every member that also says so can use it again."""
        return self._group is None or not self._group.broken

    def membership(self, group: Any) -> tuple[int, int, tuple[int, ...]]:
        return max(len(self.members), 1), self.position, self.members or (0,)

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
        """Release the channel's groups (and the last audit's, if not taken over); later exchanges fail at once."""
        if self.held is not None:
            self.held.close()
            self.held = None
        if self._group is not None:
            self._group.broken = self._group.broken or "the audit's channel was closed after the audit"
        DataPlane(self).close()
        self.pgs.clear()
