"""Whom to blame and why, from every rank's gathered step records: a pure function, the same on every rank.

The first step at which the ranks' records part decides, read in the order things happen within a step:

1. **at rest** (between the step before and this one's optimizer step): a rank whose own parameters or
   optimizer state changed while the others' did not is the one, whatever the vote; how it changed says
   what (:func:`~.records.classify`): a version counter that moved, or more elements or bits than the memory
   flips, is a write by code (``at_rest_write``, software); one or two elements by a bit or so, no counter
   moved, is the memory (``at_rest_change``, hardware-suspect); neither told is ``at_rest_change`` with
   the cause ``a change at rest`` and no hardware suspicion;
2. the **hyperparameters** changed at rest on some ranks only, or a rank took **no optimizer step**
   (``deterministic_difference``);
3. the **all-reduce** gave other bytes (``collective_mismatch``): a majority names the rank, two cannot;
4. a **gradient changed after the all-reduce** on some ranks only (``deterministic_difference``);
5. the **update**: from the same inputs, the rank whose replay of its own step does not give its own
   bytes (``update_not_reproducible``, hardware-suspect); every rank reproducing every update of the step
   is a deterministic difference in the step itself; a replay that covered part of it, was declined
   (a closure optimizer) or failed on every rank decides nothing, and the blame says why.

Nothing in the records: a strict majority of the vote (``vote``); a tie names no one (``ranks: []``).

>>> flip = {"name": "0.weight", "moved": False, "elements": 1, "compared": 128, "bits": 1}
>>> blame = decide([{"records": [{"step": 7, "pre": 1, "post": 5, "stepped": True, "rest": ["0.weight"],
...                               "rest_evidence": [flip]}]},
...                 {"records": [{"step": 7, "pre": 2, "post": 6, "stepped": True}]}], [0, 1], [])
>>> blame.ranks, blame.evidence, blame.hardware_suspect
((0,), 'at_rest_change', True)
>>> decide([{"records": [{"step": 7, "pre": 1, "stepped": True, "rest": ["0.weight"],
...                       "rest_evidence": [{**flip, "moved": True}]}]},
...         {"records": [{"step": 7, "pre": 2, "stepped": True}]}], [0, 1], []).evidence
'at_rest_write'
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Literal, Sequence, get_args

from weightsync_audit.engine.attribution import strict_majority
from weightsync_audit.engine.attribution.records import FLIP_BITS, FLIP_ELEMENTS, Change, StepRecord, classify
from weightsync_audit.reporting.validate import BLAME_EVIDENCE
from weightsync_audit.text import fmt_ranks

__all__ = ["CAUSES", "EVIDENCE", "Blame", "Evidence", "blame_hint", "checkpoint_blame", "decide", "vote_blame"]

Evidence = Literal["vote", "at_rest_change", "at_rest_write", "update_not_reproducible", "collective_mismatch",
                   "deterministic_difference", "undecided", "checkpoint"]  # fmt: skip
EVIDENCE: tuple[str, ...] = BLAME_EVIDENCE
assert EVIDENCE == get_args(Evidence), "one list of evidence"
CAUSES = {
    "at_rest_change": "memory at rest",
    "at_rest_write": "a write at rest",
    "update_not_reproducible": "compute in the step",
    "collective_mismatch": "the collective",
    "deterministic_difference": "a software difference",
    "vote": "unknown",
    "undecided": "unknown",
    "checkpoint": "the checkpoint load",
}
"""The class each evidence names (the ``cause`` of the record's ``blame``); a change at rest not told from a
write is ``a change at rest`` (:data:`UNTOLD`)."""
UNTOLD = "a change at rest"


@dataclass(frozen=True, slots=True)
class Blame:
    """Whom a divergence is blamed on and on what evidence: the record's ``blame`` (:meth:`as_dict`, its JSON)."""

    ranks: tuple[int, ...]
    """The ranks named (empty: undecided)."""
    evidence: str
    """What names them (:data:`EVIDENCE`)."""
    cause: str
    """The class the evidence names (:data:`CAUSES`)."""
    hardware_suspect: bool
    step: int | None
    """The step whose records decided (None: the vote)."""
    detail: str

    def as_dict(self) -> dict[str, Any]:
        """The record's ``blame`` field (docs/report-schema.md)."""
        return {"ranks": list(self.ranks), "evidence": self.evidence, "cause": self.cause,
                "hardware_suspect": self.hardware_suspect, "step": self.step, "detail": self.detail}  # fmt: skip

    @property
    def by_records(self) -> bool:
        """Names ranks from their own evidence (not the vote)."""
        return bool(self.ranks) and self.evidence != "vote"


def _blame(
    ranks: Sequence[int], evidence: str, hardware: bool, step: int | None, detail: str, cause: str | None = None
) -> Blame:
    return Blame(tuple(sorted(ranks)), evidence, cause or CAUSES[evidence], bool(hardware and ranks), step, detail)


def _side(flags: Sequence[bool]) -> list[int] | None:
    """The positions flagged, when some but not all are."""
    side = [i for i, f in enumerate(flags) if f]
    return side if 0 < len(side) < len(flags) else None


def _odd(values: Sequence[Any]) -> list[int] | None:
    """The positions outside a strict majority value (None: no strict majority, or all equal)."""
    top, count = Counter(values).most_common(1)[0]
    if count * 2 <= len(values) or count == len(values):
        return None
    return [i for i, v in enumerate(values) if v != top]


def _whose(ranks: Sequence[int], what: str) -> str:
    return f"rank {ranks[0]}'s {what}" if len(ranks) == 1 else f"{fmt_ranks(list(ranks))}' {what}"


def _differ(recs: Sequence[StepRecord], key: str) -> bool:
    values = [getattr(r, key) for r in recs]
    return None not in values and len(set(map(str, values))) > 1


def _counts(evidence: Sequence[Change]) -> str:
    """``0.weight: 1 bit in 1 of 128 elements`` for each tensor counted."""
    parts = []
    for e in evidence:
        if e.elements is not None:
            said = f"{e.bits} bit{'s' if e.bits != 1 else ''} in " if e.bits is not None else ""
            parts.append(f"{e.name}: {said}{e.elements} of {e.compared} elements")
    return "; ".join(parts)


def _rest_blame(
    ranks: list[int],
    step: int | None,
    changed: str,
    evidence: Sequence[Change],
    measured: dict[str, tuple[int, int]],
) -> Blame:
    """A change at rest on ``ranks`` only: a write, a bit flip, or not told apart (see :func:`~.records.classify`).
    ``measured``: name -> (elements differing from the reference at the audit, element count)."""
    kind, counts = classify(evidence), _counts(evidence)
    names = [e.name for e in evidence]
    if kind == "unknown" and names and all(n in measured for n in names) and not any(e.moved for e in evidence):
        k, n = sum(measured[x][0] for x in names), sum(measured[x][1] for x in names)
        kind = "flip" if 0 < k <= FLIP_ELEMENTS else "write" if k else "unknown"
        counts = f"{k} of {n} elements differ from the other rank(s) at this audit (bits not counted)"
    if kind == "write":
        moved = [e.name for e in evidence if e.moved]
        how = (f"{', '.join(moved)}'s version counter moved: an in-place write through torch, not the memory"
               if moved else f"more than a bit flip changes (at most {FLIP_ELEMENTS} elements by at most "
               f"{FLIP_BITS} bits each)")  # fmt: skip
        return _blame(ranks, "at_rest_write", False, step,
                      f"{changed}, written by code: {how}" + (f" ({counts})" if counts else ""))  # fmt: skip
    if kind == "flip":
        return _blame(ranks, "at_rest_change", True, step,
                      f"{changed}: {counts}, and no version counter moved, as a bit flip does")  # fmt: skip
    return _blame(ranks, "at_rest_change", False, step,
                  f"{changed}; no version counter moved and its bytes after the step were not kept (the update replay "
                  "did not cover it), so a bit flip is not told from a write through .data or a raw pointer",
                  UNTOLD)  # fmt: skip


def _replay_why(full: Sequence[StepRecord], at: list[int]) -> str:
    """Why the replay did not cover a step on every rank: declined, partial, failed."""
    why = sorted({str(r.declined) for r in full if r.declined})
    for i, r in enumerate(full):
        if not r.declined and r.covered != r.replayable:
            why.append(f"rank {at[i]} replayed {r.covered} of its {r.replayable} parameters")
        if r.failed:
            why.append(f"rank {at[i]}'s {r.failed}")
    return "; ".join(why[:4]) or "no replay covered it"


def _at_step(
    s: int,
    prev: int | None,
    recs: list[StepRecord | None],
    g: list[int],
    measured: dict[str, tuple[int, int]] | None = None,
    ongoing: bool = False,
) -> Blame | None:
    """What the records at step ``s`` say, or None when the ranks agree at it (``ongoing``: or differ only as
    a divergence decided earlier left them)."""
    full = [r or StepRecord() for r in recs]
    n = len(full)
    names = lambda idx, key: sorted({x for i in idx for x in getattr(full[i], key)})  # noqa: E731
    at = lambda idx: [g[i] for i in idx]  # noqa: E731
    since = f"between step {prev} and step {s}" if prev is not None else f"before the optimizer step of step {s}"
    pre_differ = _differ(full, "pre")
    pre_known = all(r.pre is not None for r in full)  # offloaded: a late read some rank did not complete
    side = _side([bool(r.rest) for r in full])
    if side is not None and (pre_differ or not pre_known):
        changed = (
            f"{_whose(at(side), ', '.join(names(side, 'rest')))} changed {since} with no optimizer step in between"
        )
        evidence = [e for i in side for e in full[i].rest_evidence]
        return _rest_blame(at(side), s, changed, evidence, measured or {})
    if pre_differ and all(r.rest for r in full):
        return _blame([], "at_rest_change", False, s,
                      f"every rank's tensors changed {since}, to other values: no rank alone is at fault by its own record",
                      UNTOLD)  # fmt: skip
    if _differ(full, "hyper"):
        side = _side([bool(r.hyper_changed) for r in full]) or _odd([r.hyper for r in full])
        if side is not None:
            what = "; ".join(f"rank {g[i]}: {full[i].hyper_changed or 'unchanged'}" for i in range(n))
            return _blame(at(side), "deterministic_difference", False, s,
                          f"{_whose(at(side), 'hyperparameters')} changed at rest {since} and differ from the other "
                          f"rank(s)' ({what})")  # fmt: skip
        return _blame([], "deterministic_difference", False, s, f"the hyperparameters differ at step {s} on every rank")
    side = _side([not r.stepped for r in full])
    if side is not None:
        return _blame(at(side), "deterministic_difference", False, s,
                      f"{fmt_ranks(at(side))} took no optimizer step at step {s} while the others did (a skipped step)")  # fmt: skip
    buckets = [dict(r.buckets) for r in full]
    for b in sorted(set.intersection(*(set(x) for x in buckets))) if all(buckets) else []:
        values = [x[b] for x in buckets]
        if len(set(values)) > 1:
            odd = _odd(values)
            if odd is not None:
                return _blame(at(odd), "collective_mismatch", False, s,
                              f"the all-reduce of bucket {b} at step {s} gave other bytes on {fmt_ranks(at(odd))}")  # fmt: skip
            return _blame([], "collective_mismatch", False, s,
                          f"the all-reduce of bucket {b} at step {s} gave the ranks other bytes; with no majority no "
                          "rank alone is named (the link, the library, or either rank's receive path)")  # fmt: skip
    if _differ(full, "grads"):
        side = _side([bool(r.grads_changed) for r in full]) or _odd([r.grads for r in full])
        if side is not None:
            what = ", ".join(names(side, "grads_changed")) or "gradients"
            return _blame(at(side), "deterministic_difference", False, s,
                          f"{_whose(at(side), 'gradient of ' + what)} changed after the all-reduce, before the optimizer "
                          f"step of step {s}, on that rank only (local code: clipping, unscaling, a hook)")  # fmt: skip
        return _blame([], "deterministic_difference", False, s,
                      f"the gradients differ after the all-reduce at step {s}; no rank alone changed its own")  # fmt: skip
    return _update(s, full, g, pre_known, pre_differ, ongoing)


def _update(
    s: int, full: list[StepRecord], g: list[int], pre_known: bool, pre_differ: bool, ongoing: bool = False
) -> Blame | None:
    """The update at step ``s``, read from the ranks' replays of it (the last part of :func:`_at_step`)."""
    names = lambda idx, key: sorted({x for i in idx for x in getattr(full[i], key)})  # noqa: E731
    at = lambda idx: [g[i] for i in idx]  # noqa: E731
    flagged = [bool(r.update) for r in full]
    side = _side(flagged)
    if side is not None:
        what = ", ".join(names(side, "update"))
        return _blame(at(side), "update_not_reproducible", True, s,
                      f"{_whose(at(side), 'optimizer step')} at step {s} gave other bytes ({what}) than its own replay "
                      "of it from the same pre-step values: the computation is not reproducible there")  # fmt: skip
    if ongoing:  # the ranks' steps differ as the earlier divergence left them: nothing new here
        return None
    if _differ(full, "post") and pre_known and not pre_differ:
        if all(flagged):
            return _blame([], "undecided", False, s,
                          f"from the same inputs the ranks' optimizer steps at step {s} gave other bytes, and no rank's "
                          "replay reproduced its own step: the replay does not model this optimizer's step, so it "
                          "tells nothing")  # fmt: skip
        if all(r.replayable and r.covered == r.replayable and not r.declined for r in full):
            return _blame([], "deterministic_difference", False, s,
                          f"from the same inputs the ranks' optimizer steps at step {s} gave other bytes, and each "
                          "rank's replay of every update reproduced its own: a deterministic difference in the step "
                          "itself")  # fmt: skip
        return _blame([], "undecided", False, s,
                      f"from the same inputs the ranks' optimizer steps at step {s} gave other bytes; the replay did "
                      f"not cover the whole step ({_replay_why(full, g)})")  # fmt: skip
    if pre_differ:
        return _blame(
            [], "undecided", False, s, f"the ranks already differed before step {s}: earlier than the records"
        )
    return None


def vote_blame(mismatches: Sequence[Any]) -> Blame:
    """From the vote alone (:func:`~weightsync_audit.engine.attribution.strict_majority`, the one rule): a strict
    majority names the odd ranks; a tie names no one."""
    if not mismatches:
        return _blame([], "undecided", False, None, "")
    odd, why = strict_majority(mismatches)
    if not odd:
        return _blame([], "undecided", False, None,
                      f"the vote names no one ({why}), and no rank's own record says which side is wrong")  # fmt: skip
    return _blame(odd, "vote", False, None, f"{fmt_ranks(odd)} hold the minority value(s)")


def checkpoint_blame(changed: Sequence[Any], saved: str, step: int | None) -> Blame:
    """At a load, from the sidecar: the ranks not holding what ``saved`` (the file, at its step) holds of the
    ``changed`` tensors, when every one of them has a rank holding it; else no rank named, and why."""
    names = ", ".join(sorted({m.name for m in changed})[:5])
    lost = sorted({m.name for m in changed if not m.reference_ranks})
    if lost:
        return _blame([], "undecided", False, step,
                      f"no rank holds {', '.join(lost[:5])} as saved in {saved} (its sidecar): the checkpoint "
                      "cannot say which side is right")  # fmt: skip
    odd = sorted({r for m in changed for r in m.ranks})
    held = sorted({r for m in changed for r in m.reference_ranks} - set(odd))
    return _blame(odd, "checkpoint", False, step,
                  f"{fmt_ranks(odd)} do{'es' if len(odd) == 1 else ''} not hold {names} as saved in {saved} "
                  f"(its sidecar); {fmt_ranks(held)} hold{'s' if len(held) == 1 else ''} it")  # fmt: skip


_AT_REST = ("at_rest_write", "at_rest_change")


def _explains(evidence: Sequence[Change], targets: Sequence[Any]) -> bool:
    """Whether a change at rest (its ``evidence``) can have made one of the ``targets``: it changed that tensor
    by at least half the gap the audit measured there, or by an amount not measured."""
    moved = {e.name: e.max_abs for e in evidence}
    for m in targets:
        if m.name in moved:
            amount, gap = moved[m.name], getattr(m, "max_abs_diff", None)
            if amount is None or gap is None or amount >= gap / 2:
                return True
    return False


def _weigh(
    first: tuple[Blame, Sequence[Change]], second: tuple[Blame, Sequence[Change]], mismatches: Sequence[Any]
) -> Blame:
    """Two changes at rest on other ranks, seen by one audit (an overlapped read raced the second): the ranks
    whose own change can have made the gaps the audit measured beyond any tolerance; a change far smaller
    than the gap (a tolerated drift) does not. Both can: both are named; neither: the first, as before."""
    beyond = [m for m in mismatches if getattr(m, "within_tolerance", None) is not True] or list(mismatches)
    (a, ea), (b, eb) = first, second
    a_can, b_can = _explains(ea, beyond), _explains(eb, beyond)
    if a_can and b_can:
        return _blame([*a.ranks, *b.ranks], a.evidence if a.evidence == b.evidence else "at_rest_change",
                      a.hardware_suspect and b.hardware_suspect, a.step, f"{a.detail}; and {b.detail}",
                      a.cause if a.cause == b.cause else UNTOLD)  # fmt: skip
    return b if b_can else a


def decide(
    payloads: Sequence[dict[str, Any]],
    ranks: Sequence[int],
    mismatches: Sequence[Any],
    audit_rest: Sequence[Sequence[str]] | None = None,
    ongoing: bool = False,
) -> Blame:
    """Every rank's records (rank order, ``ranks`` their global ranks) and the audit's mismatches -> the blame;
    ``ongoing``: a divergence decided earlier persists, so ranks that differ before a step tell nothing."""
    g = list(ranks)
    per = [{(int(r.step or 0), int(r.seq)): r for r in map(StepRecord.of, p.get("records", []))} for p in payloads]
    keys = sorted(set().union(*per)) if per else []
    measured = {
        m.name: (int(m.diff_count), math.prod(m.shape) if m.shape else 0)
        for m in mismatches
        if getattr(m, "diff_count", None) is not None
    }
    prev, found, at = None, None, None
    for at in keys:
        found = _at_step(at[0], prev, [d.get(at) for d in per], g, measured, ongoing)
        if found is not None:
            break
        prev = at[0]
    last = keys[-1][0] if keys else None
    side = _side([bool(x) for x in audit_rest]) if audit_rest else None
    if side is not None and audit_rest is not None and (found is None or found.evidence in _AT_REST):
        what = ", ".join(sorted({x for i in side for x in audit_rest[i]}))
        since = f"after step {last}" if last is not None else "after the last optimizer step"
        changed = f"{_whose([g[i] for i in side], what)} changed {since}, before this audit, with no optimizer step in between"
        evidence = [Change.of(e) for i in side for e in payloads[i].get("audit_rest_evidence", [])]
        later = _rest_blame([g[i] for i in side], last, changed, evidence, measured)
        if found is None:
            return later
        if not set(later.ranks) & set(found.ranks):  # two changes at rest on other ranks, seen by one audit
            earlier = [e for i, d in enumerate(per) if g[i] in found.ranks and at in d for e in d[at].rest_evidence]
            return _weigh((found, earlier), (later, evidence), mismatches)
    if found is not None:
        return found
    blame = vote_blame(mismatches)
    failed = [f"rank {g[i]} at step {r.step}: {r.failed}" for i, d in enumerate(per) for r in d.values() if r.failed]
    if failed:  # never in silence: why the records could not tell
        blame = replace(blame, detail=f"{blame.detail}; the watch failed ({'; '.join(failed[:3])})")
    return blame


_HINTS = {  # by the blame's evidence: the class it names, then what to do about it
    "at_rest_change": "a change at rest: {detail}{where}. Look for code writing to the weights between steps on that "
    "rank (through .data or a raw pointer); if there is none, test the device's memory",
    "at_rest_write": "a write at rest: {detail}{where}. Not the machine: look for code writing to the weights between "
    "steps on that rank (a load or an edit on some ranks only, an EMA kept in the parameters)",
    "update_not_reproducible": "compute in the step: {detail}{where}. Hardware-suspect: drain the host and run the "
    "vendor diagnostics before it trains again",
    "collective_mismatch": "the collective: {detail}{where}. Check the link and the communication library on that rank",
    "checkpoint": "the checkpoint load: {detail}{where}. Load the checkpoint again on that rank (or resync from a rank "
    "that holds it)",
    "deterministic_difference": "a software difference: {detail}. Not the machine: the ranks ran other code or settings",
}
_BIT_FLIP_HINT = (
    "memory at rest: {detail}{where}. A bit flip: run a memory test on that device "
    "(dcgmi diag -r 3, compute-sanitizer) before it trains again"
)


def blame_hint(blame: Blame, hosts: dict[str, str] | None) -> str:
    """The hint that names the class: memory at rest, compute in the step, the collective, software."""
    ranks, detail = blame.ranks, blame.detail
    where = "; ".join(f"rank {r} runs on {hosts[str(r)]}" for r in ranks if hosts and str(r) in hosts)
    where = f" ({where})" if where else ""
    if not ranks:
        return f"attribution undecided ({blame.cause}): {detail}"
    if blame.evidence == "at_rest_change" and blame.hardware_suspect:
        return _BIT_FLIP_HINT.format(detail=detail, where=where)
    return _HINTS.get(blame.evidence, "by vote: {detail}{where}").format(detail=detail, where=where)
