"""The audit channel's process groups: a dedicated gloo group per set of ranks, opened once.

Opening one is collective; before ``new_group`` the ranks meet in the job's store with a deadline, so a
rank that never reaches its first audit is named instead of hanging the others. Every store call is
bounded (:mod:`~weightsync_audit.channel.store`).

Lifetime: the groups are destroyed by :func:`forget_groups`, which also runs at interpreter exit (before
torch's own teardown: atexit runs last-registered first), whether or not the user destroyed the process
group; gloo contexts left to static destructors can abort the process at exit.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from weightsync_audit.channel.store import StoreLink, StoreUnreachable
from weightsync_audit.compat import default_process_group, default_store, new_named_gloo_group
from weightsync_audit.errors import AuditTimeoutError

__all__ = ["AuditGroup", "forget_groups", "late_why", "open_group"]


class AuditGroup:
    """A gloo process group for audit messages, shared by every Comm over the same ranks."""

    def __init__(self, pg: Any, ranks: tuple[int, ...], store: StoreLink) -> None:
        self.pg = pg
        self.ranks = ranks
        self.store = store
        """The job's store under a prefix unique to this group, calls bounded: where failure verdicts go."""
        self.sent_bytes = 0
        """Bytes this rank has sent over the group (frames and bodies), for benchmarks."""
        self.sent_messages = 0
        self.seq = 0
        """Exchanges done so far; every rank counts the same, so it names an exchange across ranks."""
        self.broken: str | None = None
        self.broken_kind: type[Exception] = AuditTimeoutError
        self.pending: tuple[dict[str, Any], frozenset[int]] | None = None
        """On the coordinator: a failure verdict (and the ranks it cannot reach) to deliver at the next
        exchange, when it could not answer some rank after the others had their answer."""
        # Buffers of operations that failed stay referenced: gloo may still write into them.
        self.graveyard: list[Any] = []
        self.scratch: dict[Any, tuple[memoryview, torch.Tensor]] = {}
        """Frame buffers kept from one round to the next (:meth:`frame`); emptied at any failure."""
        self.primed: dict[int, Any] = {}
        """Receives of children's next frames posted ahead of the round (:meth:`~weightsync_audit.channel.star.Comm.prime`), by position."""
        self.lock = threading.Lock()
        self.own_names = True
        """Whether every member names its gloo groups itself (this release and later); ``False`` when a
        member runs a release that lets torch name them (then this group and the data plane do too)."""
        self.hosts: list[str] | None = None
        """Where each rank of the group runs (:func:`~weightsync_audit.compat.describe_this_rank`), gathered
        once when the group opens."""
        self.block = 0
        """Ranks per block of the channel's tree (:class:`~weightsync_audit.channel.star.TreeWire`); 0: a star."""

    def drop_buffers(self) -> None:
        """After a failure: no kept buffer is used again, and the receives posted ahead are given up (their
        buffers stay referenced, as gloo may still write into them)."""
        self.scratch.clear()
        self.graveyard.extend(self.primed.values())
        self.primed.clear()

    def frame(self, key: Any, words: int) -> tuple[memoryview, torch.Tensor]:
        """A frame buffer of ``words`` int64 words (its bytes, and a tensor over them) kept for the next round: one
        is used again only after its operation completed (a failed wait forgets them all)."""
        kept = self.scratch.get(key)
        if kept is None:
            t = torch.zeros(words, dtype=torch.int64)
            kept = self.scratch[key] = (memoryview(t.numpy()).cast("B"), t)
        return kept


_groups: dict[tuple[int, tuple[int, ...]], tuple[Any, AuditGroup]] = {}
_generations: dict[tuple[int, ...], int] = {}
_failed_opens: dict[tuple[int, tuple[int, ...]], tuple[Any, AuditTimeoutError]] = {}
_groups_lock = threading.Lock()
_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"


def _store_prefix(ranks: tuple[int, ...], generation: int) -> str:
    return f"weightsync_audit/{'.'.join(map(str, ranks))}/{generation}"


def _group_name(ranks: tuple[int, ...], generation: int) -> str:
    """The gloo group's name (and its store prefix): the same on every member, whatever other groups exist."""
    return f"weightsync_audit.channel:{'.'.join(map(str, ranks))}:{generation}"


_WHERE_PREFIX = "weightsync_audit/where/"
"""Under it, each global rank's latest opening (``{"ranks": [...], "opening": n}``): read by the first rank
to give up waiting, to name what the ranks disagree on instead of only who did not come."""


def open_group(ranks: tuple[int, ...], my_rank: int, deadline_s: float, grace_s: float) -> AuditGroup:
    """Meet the other ranks in the store (deadline ``deadline_s``), then create the gloo group."""
    default_pg = default_process_group()
    key = (id(default_pg), ranks)
    with _groups_lock:
        hit = _groups.get(key)
        if hit is not None and hit[0] is default_pg:
            return hit[1]
        failed = _failed_opens.get(key)
        if failed is not None and failed[0] is default_pg:
            raise failed[1]
        # Every rank opens the groups over the same ranks in the same order, so the generation (how
        # many times this process opened one) names the same attempt on every rank.
        generation = _generations.get(ranks, 0)
        _generations[ranks] = generation + 1
        store = StoreLink(default_store(), _store_prefix(ranks, generation))
        try:
            own_names = _meet(store, ranks, my_rank, generation, deadline_s, grace_s)
            # Only the member ranks take part in creating the group, so an audit over a subgroup never
            # waits on ranks outside it; its name comes from what the ranks just met on, not from how
            # many groups this process belongs to, which differs per rank once another library made
            # groups that not every rank belongs to (issue 36). A member on an earlier release lets
            # torch name it; then every member does, as that release does.
            limit = timedelta(seconds=max(deadline_s, 1.0) + grace_s)
            with _lazy_gloo():
                if own_names:
                    pg = new_named_gloo_group(ranks, _group_name(ranks, generation), limit)
                else:
                    pg = dist.new_group(list(ranks), timeout=limit, backend="gloo", use_local_synchronization=True)
            _first_contact(pg, ranks, my_rank, deadline_s, grace_s)
        except AuditTimeoutError as exc:
            _failed_opens[key] = (default_pg, exc)
            raise
        except Exception as exc:
            err = AuditTimeoutError(
                f"weightsync audit: could not open the audit channel among ranks {list(ranks)} "
                f"(this is rank {ranks[my_rank]}): {exc}; a rank died or stopped while it was being set up"
            )
            _failed_opens[key] = (default_pg, err)
            raise err from exc
        group = AuditGroup(pg, ranks, store)
        group.own_names = own_names
        _groups[key] = (default_pg, group)
        return group


@contextmanager
def _lazy_gloo() -> Iterator[None]:
    """Let gloo connect a pair of ranks on its first message instead of all pairs at creation.

    The channel is a star: each rank talks to the coordinator only, so a lazy group holds W - 1
    connections instead of W(W - 1) / 2, and opening it costs a store round instead of a full mesh
    (measured at 32 ranks on 2 cores: 18 ms instead of 262 ms). torch reads ``TORCH_GLOO_LAZY_INIT`` when
    it creates a gloo group; it is set only around this creation (under the groups' lock).
    """
    before = os.environ.get(_LAZY_ENV)
    os.environ[_LAZY_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_LAZY_ENV, None)
        else:
            os.environ[_LAZY_ENV] = before


def _first_contact(pg: Any, ranks: tuple[int, ...], my_rank: int, deadline_s: float, grace_s: float) -> None:
    """Connect each pair of the star now, while every rank is known to be here (they have just met).

    In a lazy gloo group a pair connects on its first message, and that connect blocks the caller inside
    ``irecv`` with gloo's own timeout (measured: about 35 s, in 1 try of 4) before any deadlined wait
    starts: a rank that never reached its first audit would hold the coordinator that long. One message
    from each rank to the coordinator, posted and awaited in a helper thread that this rank waits for at
    most ``deadline_s + grace_s``, connects every pair the star uses; later rounds find them connected.
    """
    if len(ranks) < 2:
        return
    peers = list(ranks[1:]) if my_rank == 0 else [ranks[0]]
    reached: list[int] = []
    failure: list[str] = []
    done = threading.Event()

    def contact() -> None:
        try:
            limit = timedelta(seconds=max(deadline_s, 1.0) + grace_s)
            if my_rank == 0:
                bufs = [torch.zeros(1, dtype=torch.int64) for _ in peers]
                works = [dist.irecv(b, src=r, group=pg) for b, r in zip(bufs, peers)]
            else:
                bufs = [torch.full((1,), ranks[my_rank], dtype=torch.int64)]
                works = [dist.isend(bufs[0], dst=peers[0], group=pg)]
            for r, work in zip(peers, works):
                work.wait(timeout=limit)
                reached.append(r)
        except Exception as exc:  # noqa: BLE001 - reported below, as a timeout naming the ranks not reached
            failure.append(str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__)
        finally:
            done.set()

    threading.Thread(target=contact, name="weightsync-audit-first-contact", daemon=True).start()
    if done.wait(deadline_s + grace_s) and not failure:
        return
    missing = [r for r in peers if r not in reached]
    why = f": {failure[0]}" if failure else ""
    raise AuditTimeoutError(
        f"weightsync audit: rank(s) {missing} could not be reached within {deadline_s + grace_s:g}s while the "
        f"audit channel was opened (this is rank {ranks[my_rank]} of {len(ranks)}){why}; a rank died or "
        "stopped right after the ranks met",
        missing,
    )


def _meet(
    link: StoreLink, ranks: tuple[int, ...], my_rank: int, generation: int, deadline_s: float, grace_s: float
) -> bool:
    """Store-side rendezvous with a deadline: the last to arrive says 'ok', the first to give up says
    who is missing (and what the missing ones are opening instead, if anything), and whichever is written
    first is what every rank acts on. Returns whether every rank names its gloo groups itself (the same on
    every rank: each counts itself in before it counts as arrived, and all read after the last arrived)."""
    me = ranks[my_rank]
    where = dist.PrefixStore(_WHERE_PREFIX, default_store())  # outside any group's prefix
    view = json.dumps({"ranks": list(ranks), "opening": generation + 1})
    try:
        decision = link.call(
            lambda store: _meet_in(store, where, view, ranks, my_rank, deadline_s), deadline_s + grace_s
        )
    except StoreUnreachable as exc:
        raise AuditTimeoutError(
            f"weightsync audit: the job's store stopped answering while the ranks met to open the audit "
            f"channel (this is rank {me}): {exc}; its host, usually global rank 0, died or is stopped",
            [0],
        ) from exc
    _check_decision(decision[0], ranks, me, deadline_s)
    return decision[1]


def _meet_in(
    store: Any, where: Any, view: str, ranks: tuple[int, ...], my_rank: int, deadline_s: float
) -> tuple[str, bool]:
    where.set(str(ranks[my_rank]), view)
    store.set(f"arrived/{my_rank}", "1")
    store.add("own_names", 1)
    if store.add("count", 1) == len(ranks):
        store.compare_set("decision", "", "ok")
    try:
        store.wait(["decision"], timedelta(seconds=deadline_s))
        decision = store.get("decision").decode()
        return decision, decision == "ok" and store.add("own_names", 0) == len(ranks)
    except Exception:  # noqa: BLE001 - DistStoreError on timeout
        missing = [ranks[r] for r in range(len(ranks)) if not store.check([f"arrived/{r}"])]
        views = _views(where, ranks)
        verdict = json.dumps({"missing": missing, "views": views})
        return store.compare_set("decision", "", "missing " + verdict).decode(), False


def _views(where: Any, ranks: tuple[int, ...]) -> dict[str, str]:
    """Each rank's latest opening, for ``ranks`` and every rank named in what they open (transitively), so
    that ranks on either side of a disagreement describe it in the same words."""
    views: dict[str, str] = {}
    todo = list(ranks)
    while todo:
        r = todo.pop(0)
        if str(r) in views or not where.check([str(r)]):
            continue
        views[str(r)] = where.get(str(r)).decode()
        todo.extend(json.loads(views[str(r)])["ranks"])
    return views


def _disagreement(views: dict[str, str]) -> str:
    """What the ranks are opening, when they do not all open the same channel: '' when they agree."""
    by_view: dict[str, list[int]] = {}
    for rank, view in sorted(views.items(), key=lambda kv: int(kv[0])):
        by_view.setdefault(view, []).append(int(rank))
    if len(by_view) < 2:
        return ""
    parts = []
    for view, who in sorted(by_view.items(), key=lambda kv: kv[1]):
        seen = json.loads(view)
        parts.append(f"rank(s) {who} open the audit channel among ranks {seen['ranks']} (opening #{seen['opening']})")
    return (
        "; the ranks disagree on the audit group: "
        + "; ".join(parts)
        + " (every rank of a group must call the audit with the same group=, and open it as often)"
    )


def _check_decision(decision: str, ranks: tuple[int, ...], me: int, deadline_s: float) -> None:
    if decision == "ok":
        return
    verdict = json.loads(decision.split(" ", 1)[1]) if decision.startswith("missing ") else {}
    if isinstance(verdict, list):  # written by a version before the views were named
        verdict = {"missing": verdict}
    missing = verdict.get("missing", [])
    raise AuditTimeoutError(
        f"weightsync audit: rank(s) {missing} did not arrive at the first audit within {deadline_s:g}s "
        f"(this is rank {me}, one of {len(ranks)}); {late_why(me, missing)}{_disagreement(verdict.get('views', {}))}",
        missing,
    )


def late_why(me: int, missing: Sequence[int]) -> str:
    """Why the ranks ``missing`` did not arrive, as rank ``me`` (global ranks) can tell."""
    if me in missing:
        return "this rank arrived after the others had given up waiting for it"
    return "a rank is stuck, dead, or auditing at a different point"


def forget_groups() -> None:
    """Drop cached audit groups (after ``destroy_process_group``, and at exit); the next audit makes new ones."""
    with _groups_lock:
        for _, group in _groups.values():
            group.broken = group.broken or "the audit channel was closed"
            try:
                if dist.is_initialized():
                    dist.destroy_process_group(group.pg)
            except Exception:  # noqa: BLE001 - the default group may already be gone
                pass
        _groups.clear()
        _failed_opens.clear()


atexit.register(forget_groups)
