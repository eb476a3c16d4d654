"""The audit channel's process groups: a dedicated gloo group per set of ranks, opened once.

Opening one is collective; before ``new_group`` the ranks meet in the job's store with a deadline, so a
rank that never reaches its first audit is named instead of hanging the others. Every store call is
bounded (:mod:`~weightsync_audit.channel.storelink`).

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
from typing import Any

import torch
import torch.distributed as dist

from weightsync_audit.channel.storelink import StoreLink, StoreUnreachable
from weightsync_audit.compat import default_process_group, default_store
from weightsync_audit.errors import AuditTimeoutError

__all__ = ["AuditGroup", "forget_groups", "open_group"]


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
        self.lock = threading.Lock()
        self.hosts: list[str] | None = None
        """Where each rank of the group runs (:func:`~weightsync_audit.compat.describe_this_rank`), gathered
        once when the group opens."""


_groups: dict[tuple[int, tuple[int, ...]], tuple[Any, AuditGroup]] = {}
_generations: dict[tuple[int, ...], int] = {}
_failed_opens: dict[tuple[int, tuple[int, ...]], tuple[Any, AuditTimeoutError]] = {}
_groups_lock = threading.Lock()
_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"


def _store_prefix(ranks: tuple[int, ...], generation: int) -> str:
    return f"weightsync_audit/{'.'.join(map(str, ranks))}/{generation}"


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
            _meet(store, ranks, my_rank, deadline_s, grace_s)
            # Only the member ranks take part in creating the group (use_local_synchronization), so an
            # audit over a subgroup never waits on ranks outside it.
            with _lazy_gloo():
                pg = dist.new_group(
                    ranks=list(ranks),
                    backend="gloo",
                    timeout=timedelta(seconds=max(deadline_s, 1.0) + grace_s),
                    use_local_synchronization=True,
                )
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


def _meet(link: StoreLink, ranks: tuple[int, ...], my_rank: int, deadline_s: float, grace_s: float) -> None:
    """Store-side rendezvous with a deadline: the last to arrive says 'ok', the first to give up says
    who is missing, and whichever is written first is what every rank acts on."""
    me = ranks[my_rank]
    try:
        decision = link.call(lambda store: _meet_in(store, ranks, my_rank, deadline_s), deadline_s + grace_s)
    except StoreUnreachable as exc:
        raise AuditTimeoutError(
            f"weightsync audit: the job's store stopped answering while the ranks met to open the audit "
            f"channel (this is rank {me}): {exc}; its host, usually global rank 0, died or is stopped",
            [0],
        ) from exc
    _check_decision(decision, ranks, me, deadline_s)


def _meet_in(store: Any, ranks: tuple[int, ...], my_rank: int, deadline_s: float) -> str:
    store.set(f"arrived/{my_rank}", "1")
    if store.add("count", 1) == len(ranks):
        store.compare_set("decision", "", "ok")
    try:
        store.wait(["decision"], timedelta(seconds=deadline_s))
        return store.get("decision").decode()
    except Exception:  # noqa: BLE001 - DistStoreError on timeout
        missing = [ranks[r] for r in range(len(ranks)) if not store.check([f"arrived/{r}"])]
        return store.compare_set("decision", "", "missing " + json.dumps(missing)).decode()


def _check_decision(decision: str, ranks: tuple[int, ...], me: int, deadline_s: float) -> None:
    if decision == "ok":
        return
    missing = json.loads(decision.split(" ", 1)[1]) if decision.startswith("missing ") else []
    if me in missing:
        why = "this rank arrived after the others had given up waiting for it"
    else:
        why = "a rank is stuck, dead, or auditing at a different point"
    raise AuditTimeoutError(
        f"weightsync audit: rank(s) {missing} did not arrive at the first audit within {deadline_s:g}s "
        f"(this is rank {me} of {len(ranks)}); {why}",
        missing,
    )


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
