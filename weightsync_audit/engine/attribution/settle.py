"""The watch on a training run: set once (:func:`attach_watch`; the callbacks and ``LoopAudit`` call it), and at
an audit the blame for a divergence (collective, off the healthy path), the watch kept in step.

On a divergent audit every rank sends its step records (one message, JSON) and every rank decides the
same blame from the same gathered records (:func:`~.blame.decide`). Without a watch the vote alone
decides, with no message. An in-sync full audit empties the records: nothing before it is in doubt. A
blame lives as long as its evidence explains the mismatches (:func:`attribute_audit`).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import numpy as np
import torch

from weightsync_audit.channel.star import Comm
from weightsync_audit.compat import describe_this_rank
from weightsync_audit.engine.attribution.blame import blame_hint, decide, vote_blame
from weightsync_audit.engine.attribution.watch import StepWatch
from weightsync_audit.engine.config import AuditRequest
from weightsync_audit.engine.explain.evidence import find_ddp
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest
from weightsync_audit.engine.inventory.manifest import as_optimizers

__all__ = [
    "attach_watch",
    "attribute_audit",
    "explained_pairs",
    "param_names",
    "watch_run",
]


def explained_pairs(mismatches: Sequence[Any]) -> frozenset[tuple[str, int]]:
    """The (tensor, rank) pairs a blame explains: each differing tensor with the ranks outside its reference
    (on a tie, every rank involved: which side is the reference is not evidence)."""
    return frozenset(
        (m.name, r) for m in mismatches for r in (*m.ranks, *(m.reference_ranks if getattr(m, "tie", False) else ()))
    )


def attribute_audit(
    watch: StepWatch | None,
    comm: Comm,
    mismatches: Sequence[Any],
    *,
    prepared: PreparedManifest,
    digests: np.ndarray,
    full: bool,
    hosts: dict[str, str] | None,
    hints: list[str],
    request: AuditRequest,
) -> tuple[dict[str, Any] | None, dict[str, str] | None, list[str]]:
    """A finished audit's blame (None when in sync: the watch is emptied), with its ``hosts`` and ``hints``:
    with a watch (collective then), the blame's hint first and the blamed ranks' hosts added. An audit beside
    the run's own (``request`` not ``counted``) reads the records and the kept blame, never changes them, and
    compares nothing with the bytes after the last step (a repair's confirmation reads repaired ones); one
    ``before_step`` exchanges the step under way's record too.

    A blame lives as long as its evidence explains the mismatches: every divergent audit exchanges the records
    taken since the last one; a rank they name decides afresh, and so does a (tensor, rank) pair the kept blame
    did not explain (a second fault while a tolerated or unrepaired divergence persists: its own records, else
    the vote)."""
    if not mismatches:
        if watch is not None and request.counted:  # an in-sync audit empties the records (a full one, all of them)
            watch.found = None
            if full:
                watch.in_sync()
        return None, hosts, hints
    pairs = explained_pairs(mismatches)
    if watch is None:
        blame, where = vote_blame(mismatches), {}
    else:  # collective: every rank exchanges its records, from the same audit
        kept = watch.found
        mine = watch.payload(request.before_step)
        # Against the bytes after the last step: the run's own audits only (a confirmation reads repaired ones).
        at_mark = full and request.counted
        mine["audit_rest"] = watch.changed_since_mark(prepared, digests) if at_mark else []
        mine["audit_rest_evidence"] = [e.as_dict() for e in watch.audit_evidence] if at_mark else []
        mine["host"] = describe_this_rank()
        gathered = [json.loads(b) for b in comm.exchange_bytes(json.dumps(mine).encode(), "the attribution records")]
        ranks = list(comm.global_ranks)
        rest = [p.get("audit_rest", []) for p in gathered]
        blame = decide(gathered, ranks, mismatches, rest, ongoing=kept is not None)  # an earlier divergence persists
        where = {str(r): str(p.get("host", "")) for r, p in zip(ranks, gathered) if r in blame.ranks}
        if kept is not None and not blame.by_records and pairs <= kept[2]:  # the same divergence, still explained
            blame, where, pairs = kept
        if request.counted:
            watch.found = blame, where, pairs  # its records reported (a resync after it is no change at rest)
            watch.records.clear()
    if where:
        hosts = {**(hosts or {}), **where}
    if watch is not None and blame.detail:  # without a watch the vote is said already
        hints = [blame_hint(blame, hosts), *hints]
    return blame.as_dict(), hosts, hints


_WRAPPERS = ("module.", "_forward_module.", "_orig_mod.")


def param_names(model: Any) -> dict[int, str]:
    """id(parameter) -> its name without the wrappers' prefixes (``module.`` of DDP, Lightning's, compile's)."""
    if not isinstance(model, torch.nn.Module):
        return {}
    out = {}
    for name, p in model.named_parameters():
        while name.startswith(_WRAPPERS):
            name = name.split(".", 1)[1]
        out.setdefault(id(p), name)
    return out


def attach_watch(
    auditor: Any,
    model: Any,
    optimizers: Sequence[Any],
    *,
    hook: Callable[..., Any] | None = None,
    state: Any = None,
    offload: bool = False,
) -> StepWatch:
    """A :class:`StepWatch` over ``auditor``'s own manifest of ``model`` and ``optimizers``, its hooks set
    (with ``collective``, DDP's comm hook: ``hook``/``state`` are one the user's DDP already runs).
    ``offload``: the at-rest reads on a worker thread, off the training thread (what ``overlap=True`` sets;
    :mod:`~weightsync_audit.engine.attribution.offload`)."""
    cfg = auditor.config
    opts = as_optimizers(optimizers)
    ddp = find_ddp(model) if model is not None else None
    watch = StepWatch(
        cfg.attribution,
        prepare=lambda: auditor.prepare(model, opts, ddp=ddp),
        optimizers=opts,
        names=param_names(model),
        capacity=cfg.pinpoint_ring,
        method=cfg.method,
        offload=offload,
    )
    watch.attach(ddp, hook, state)
    watch.baseline()  # the bytes at rest from here: a change before the first step is seen against them
    return watch


def watch_run(runner: Any, model: Any, optimizers: Sequence[Any]) -> None:
    """For an open :class:`~weightsync_audit.integrations.session.runner.AuditRunner` whose options ask for
    ``attribution``: set the watch on its main auditor (once, local); with ``overlap``, its at-rest reads
    off the training thread too."""
    auditor = runner.auditor
    if auditor is not None and auditor.config.attribution is not None and auditor.attribution is None:
        offload = getattr(runner, "overlap", None) is not None
        auditor.attribution = attach_watch(auditor, model, optimizers, offload=offload)
