"""Who takes part in one audit across replica groups: a roll call in the quorum's store, with a deadline.

A quorum names its replica groups, but not every one of them reaches a given audit: a group whose step
did not commit, or that died after the quorum formed, never comes. The roll never waits for them past
its deadline: each member writes its entry (replica rank and id, whether it healed at this step and from
whom, its step counters, its history) and counts itself in; the last of the quorum to arrive closes the
roll with everyone, and otherwise the first member to give up closes it with those present. Whichever
closes it first is what every member acts on: a member that arrives after the roll closed without it
takes no part (its audit reports so; nobody waits for it). Every member then reads the same entries, so
each takes the same decisions.

The order of the members is the channel's position order: the source of a heal first, then the other
replicas that did not heal, then those that healed, each by replica rank. The coordinator is thus a
replica that did not heal, and a tie vote goes to the source, never to the replica being verified.

>>> order([Member(0, "a", healed=True, source=1), Member(1, "b"), Member(2, "c")])
(1, 2, 0)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Sequence

from weightsync_audit.channel.groups import StoreLink, StoreUnreachable
from weightsync_audit.errors import AuditTimeoutError

__all__ = ["Member", "Roll", "call_roll", "order"]


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
    """Step counters and declared state, each ``[kind, value]`` (:mod:`~.counters`)."""
    last_in_sync_step: int | None = None
    channel: str | None = None
    """The audit channel this member holds open and whole (its prefix): reused when every member holds it."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class Roll:
    """The members of one audit, in position order, and the quorum's replicas that did not come."""

    members: tuple[Member, ...]
    absent: tuple[int, ...]
    position: int | None
    """This process's position, or ``None`` when the roll closed without it."""

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


def call_roll(link: StoreLink, me: Member, expected: int, wait_s: float, bound_s: float) -> Roll:
    """Meet the quorum's ``expected`` replicas under ``link``'s prefix; at most ``wait_s`` for latecomers.

    Raises :class:`AuditTimeoutError` when the store does not answer within ``bound_s``."""
    try:
        raw = link.call(lambda store: _roll(store, me, expected, wait_s), bound_s)
    except StoreUnreachable as exc:
        raise AuditTimeoutError(
            f"weightsync audit: the quorum's store did not answer while the replicas met for the audit: {exc}"
        ) from exc
    members = [Member(**entry) for entry in json.loads(raw)]
    by_rank = {m.replica_rank: m for m in members}
    ranked = order(members)
    return Roll(
        members=tuple(by_rank[r] for r in ranked),
        absent=tuple(r for r in range(expected) if r not in by_rank),
        position=ranked.index(me.replica_rank) if me.replica_rank in by_rank else None,
    )


def _roll(store: Any, me: Member, expected: int, wait_s: float) -> bytes:
    """The roll's decision: the entries of those it closed with (4 store round trips when all come)."""
    store.set(f"member/{me.replica_rank}", me.to_json())
    if store.add("count", 1) >= expected:  # the last to arrive: every entry is there
        return store.compare_set("decision", "", _entries(store, list(range(expected))))
    try:
        store.wait(["decision"], timedelta(seconds=max(wait_s, 0.001)))
        return store.get("decision")
    except Exception:  # noqa: BLE001 - DistStoreError on timeout: close the roll with those present
        present = [r for r in range(expected) if store.check([f"member/{r}"])]
        return store.compare_set("decision", "", _entries(store, present))  # or the decision taken first


def _entries(store: Any, ranks: list[int]) -> str:
    raw = store.multi_get([f"member/{r}" for r in ranks]) if ranks else []
    return "[" + ",".join(r.decode() for r in raw) + "]"
