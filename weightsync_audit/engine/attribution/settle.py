"""The watch on a training run: set once (:func:`attach_watch`; the callbacks and ``LoopAudit`` call it), and at
an audit the blame for a divergence (collective, off the healthy path), the watch kept in step.

On a divergent audit every rank sends its step records (one message, JSON) and every rank decides the
same blame from the same gathered records (:func:`~.blame.decide`). Without a watch the vote alone
decides, with no message. An in-sync full audit empties the records: nothing before it is in doubt. A
blame lives as long as its evidence explains the mismatches (:func:`attribute_audit`).

Who is wrong, whatever named it, is one pure function of the vote's majority and the current blame, also
settled here: :func:`culprit`. Everything that names a rank as the wrong one reads it, so that a record never blames
one rank while its repair copies from it or its evict file names the other: the resync source on a tie
(:func:`resync_source`, for :mod:`~weightsync_audit.engine.respond`), the blame by vote
(:func:`~weightsync_audit.engine.attribution.blame.vote_blame`), the machines handed on for eviction
(:mod:`~weightsync_audit.integrations.evict`) and the "machine" wording of the hints
(:func:`~weightsync_audit.engine.measure.finite.persistent_hints`). The rules, in order:

1. attribution's blame, when it names ranks from their own per-step records (any evidence but the vote),
   names them; it is evidence about their *machine* only when it is hardware-suspect;
2. else a strict majority on every differing tensor names the ranks outside it: evidence that they hold
   the odd value, not that their machine is at fault;
3. else (a tie, or no strict majority, and nothing else) no rank is named: no eviction, and a resync keeps
   ``resync_src`` and says that it was chosen without evidence.

Whatever the vote, a rank whose second read of a tensor gave other bytes (``stability == "unstable"``) is
evidence about its machine. The blame read is the current one: the audit's own, about the divergence in
front of it (an earlier divergence's blame is dropped when the replicas agree again or a repair is
confirmed).

>>> from weightsync_audit.reporting.record import Mismatch
>>> tie = Mismatch("w", "param", [1], [0], detail="tie vote: rank 0 vs rank 1, no majority")
>>> culprit([tie], None).ranks
()
>>> flip = {"ranks": [0], "evidence": "at_rest_change", "hardware_suspect": True, "detail": "w changed"}
>>> culprit([tie], flip).ranks, culprit([tie], flip).machine
((0,), (0,))
>>> culprit([Mismatch("w", "param", [2], [0, 1])], None).ranks
(2,)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from weightsync_audit.channel.star import Comm
from weightsync_audit.compat import describe_this_rank
from weightsync_audit.engine.attribution.blame import blame_hint, decide, strict_majority, vote_blame
from weightsync_audit.engine.attribution.watch import StepWatch
from weightsync_audit.engine.explain.evidence import find_ddp
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest
from weightsync_audit.engine.inventory.manifest import as_optimizers
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import fmt_ranks

__all__ = [
    "Culprit",
    "attach_watch",
    "attribute_audit",
    "culprit",
    "explained_pairs",
    "mark_step",
    "param_names",
    "resync_source",
    "watch_run",
]


@dataclass(frozen=True, slots=True)
class Culprit:
    """Who is wrong, on what evidence, and whose machine is suspect."""

    ranks: tuple[int, ...]
    """The ranks named as holding the wrong values (empty: no rank can be named)."""
    evidence: str
    """What names them: attribution's evidence (``at_rest_change``, ...), ``majority``, or ``none``."""
    machine: tuple[int, ...]
    """The ranks with evidence about their machine: a hardware-suspect blame, or an unstable second read."""
    why: str
    """In words: the evidence that names them, or why no rank can be named."""

    @property
    def by_records(self) -> bool:
        """Named by attribution's per-step records (not by the vote)."""
        return self.evidence not in ("majority", "none")


def culprit(mismatches: Sequence[Mismatch], blame: Mapping[str, Any] | None) -> Culprit:
    """Who is wrong in a divergence (``mismatches``, with the ``blame`` the same audit decided); pure, so the
    same on every rank."""
    unstable = tuple(sorted({r for m in mismatches if m.stability == "unstable" for r in m.ranks}))
    blame = blame or {}
    named = sorted(set(blame.get("ranks") or []))
    evidence = str(blame.get("evidence") or "")
    if named and evidence != "vote":
        hardware = named if blame.get("hardware_suspect") else []
        why = f"attribution's blame ({evidence}): {blame.get('detail') or ''}".rstrip(": ")
        return Culprit(tuple(named), evidence, tuple(sorted({*hardware, *unstable})), why)
    odd, why = strict_majority(mismatches)
    if odd:
        return Culprit(
            tuple(odd), "majority", unstable, f"a strict majority holds the reference value, {fmt_ranks(odd)} another"
        )
    if not mismatches:
        return Culprit((), "none", unstable, "nothing differs")
    return Culprit((), "none", unstable, f"{why}, and no rank's own per-step record says which side is wrong")


def resync_source(mismatches: Sequence[Mismatch], blame: Mapping[str, Any] | None, src: Any) -> tuple[Any, str | None]:
    """The resync source for a divergence with a tie vote, and what chose it, for the plan's note (``None``:
    no tie, ``src`` as it is).

    The blame, when it names ranks by their records, decides: ``src`` unless it is blamed, else the lowest
    rank involved that is not (never the blamed side over the other). With nothing but the tie, ``src`` is
    kept and the words say it was chosen without evidence. A tensor whose copies differ in holding NaN/inf
    is not counted: its finite copy is the evidence
    (:func:`~weightsync_audit.engine.repair.plan.plan_resync`).

    >>> tie = Mismatch("w", "param", [1], [0], detail="tie vote: rank 0 vs rank 1, no majority")
    >>> resync_source([tie], None, 0)[1]
    "resync_src, chosen without evidence: no rank's own record says which side is wrong"
    >>> resync_source([tie], {"ranks": [0], "evidence": "at_rest_change", "hardware_suspect": True}, 0)
    (1, 'not resync_src: rank 0 blamed by attribution (at_rest_change)')
    """
    if not any(m.tie and m.reference_ranks and m.kind != "structure" and not m.nonfinite for m in mismatches):
        return src, None
    who = culprit(mismatches, blame)
    if not who.by_records:
        chooser = "resync_src" if src != "majority" else "the side holding the lowest rank"
        return src, f"{chooser}, chosen without evidence: no rank's own record says which side is wrong"
    blamed = set(who.ranks)
    involved = sorted({r for m in mismatches for r in (*m.ranks, *m.reference_ranks)})
    if src != "majority" and src in involved and src not in blamed:
        return src, f"resync_src; {fmt_ranks(list(who.ranks))} blamed by attribution ({who.evidence})"
    chosen = next((r for r in involved if r not in blamed), None)
    if chosen is None:
        return src, f"resync_src: every rank involved is blamed by attribution ({who.evidence})"
    return chosen, f"not resync_src: {fmt_ranks(list(who.ranks))} blamed by attribution ({who.evidence})"


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
) -> tuple[dict[str, Any] | None, dict[str, str] | None, list[str]]:
    """A finished audit's blame (None when in sync: the watch is emptied), with its ``hosts`` and ``hints``:
    with a watch (collective then), the blame's hint first and the blamed ranks' hosts added.

    A blame lives as long as its evidence explains the mismatches: every divergent audit exchanges the records
    taken since the last one; a rank they name decides afresh, and so does a (tensor, rank) pair the kept blame
    did not explain (a second fault while a tolerated or unrepaired divergence persists: its own records, else
    the vote)."""
    if not mismatches:
        if watch is not None:  # an in-sync audit empties the records (a full one, all of them)
            watch.found = None
            if full:
                watch.in_sync()
        return None, hosts, hints
    pairs = explained_pairs(mismatches)
    if watch is None:
        blame, where = vote_blame(mismatches), {}
    else:  # collective: every rank exchanges its records, from the same audit
        kept = watch.found
        mine = watch.payload()
        mine["audit_rest"] = watch.changed_since_mark(prepared, digests) if full else []
        mine["audit_rest_evidence"] = [e.as_dict() for e in watch.audit_evidence] if full else []
        mine["host"] = describe_this_rank()
        gathered = [json.loads(b) for b in comm.exchange_bytes(json.dumps(mine).encode(), "the attribution records")]
        ranks = list(comm.global_ranks)
        rest = [p.get("audit_rest", []) for p in gathered]
        blame = decide(gathered, ranks, mismatches, rest, ongoing=kept is not None)  # an earlier divergence persists
        where = {str(r): str(p.get("host", "")) for r, p in zip(ranks, gathered) if r in blame.ranks}
        if kept is not None and not blame.by_records and pairs <= kept[2]:  # the same divergence, still explained
            blame, where, pairs = kept
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
    return watch


def watch_run(runner: Any, model: Any, optimizers: Sequence[Any]) -> None:
    """For an open :class:`~weightsync_audit.integrations.session.runner.AuditRunner` whose options ask for
    ``attribution``: set the watch on its main auditor (once, local); with ``overlap``, its at-rest reads
    off the training thread too."""
    auditor = runner.auditor
    if auditor is not None and auditor.config.attribution is not None and auditor.attribution is None:
        offload = getattr(runner, "overlap", None) is not None
        auditor.attribution = attach_watch(auditor, model, optimizers, offload=offload)


def mark_step(runner: Any, step: int) -> None:
    """After every optimizer step: the watch's record of it closed under ``step`` (local, no message)."""
    watch = getattr(runner.auditor, "attribution", None)
    if watch is not None:
        watch.mark(step)
