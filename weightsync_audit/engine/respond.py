"""What an audit's result leads to, for the callbacks and the plain loop alike: ``warn``, ``raise`` or
``resync`` (repair from the ranks holding the reference, then a full audit to confirm), the report line,
and what is printed: a divergence when it appears or changes, once; a cause that persists across resyncs
as one line ("resynced again"), and after :data:`ESCALATE_AFTER` resyncs of the same tensors one warning
that the cause persists.

Every decision here is taken from the gathered result, equal on every rank; only the printing and the
report writing happen on the main process.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from weightsync_audit.engine.culprit import resync_source
from weightsync_audit.engine.repair.resync import resync_planned
from weightsync_audit.engine.repair.resync_plan import ResyncPlan, ResyncSource, plan_resync
from weightsync_audit.engine.repair.state import ResyncState
from weightsync_audit.engine.timeline.history import AuditHistory
from weightsync_audit.errors import ResyncError, WeightSyncWarning, user_stacklevel
from weightsync_audit.reporting.record import AuditResult

__all__ = ["ESCALATE_AFTER", "Voice", "respond"]

log = logging.getLogger("weightsync_audit")

ESCALATE_AFTER = 3
"""Resyncs of the same tensors after which the printed report says, once, that the cause persists."""


def respond(
    result: AuditResult,
    on_mismatch: str,
    *,
    model: Any,
    optimizers: Sequence[Any],
    resync_src: ResyncSource,
    confirm: Callable[[bool], AuditResult],
    history: AuditHistory,
    prepare: Callable[[AuditResult, Any, Sequence[Any]], ResyncState],
    repaired: Callable[[int | None], None] | None = None,
) -> ResyncPlan | None:
    """Set ``result.action`` and, under ``resync``, repair and confirm (collective: every rank calls it).

    ``prepare(result, model, optimizers)``: what the resync reads, the audit's own prepared state when it is
    still what is held (:meth:`Auditor.resync_state <weightsync_audit.engine.auditor.Auditor.resync_state>`).
    ``repaired(step)``: called once a repair is confirmed, to drop the per-step evidence about the divergence
    it ended (:meth:`Auditor.repaired <weightsync_audit.engine.auditor.Auditor.repaired>`). Returns the resync's
    plan when one ran (its :meth:`~ResyncPlan.receivers` are the ranks it repaired), else ``None``."""
    if result.in_sync or result.within_tolerance:
        result.action = "none"  # within the tolerance: kept in the record, not acted on
    elif on_mismatch == "raise":
        result.action = "raised"
    elif on_mismatch != "resync":
        result.action = "warned"
    elif (plan := _plan(result, resync_src)) is not None:
        # One broadcast per source rank, from the audit's channel and manifest (nothing prepared twice).
        resync_planned(prepare(result, model, list(optimizers)), plan)
        confirmed = confirm(bool(plan.grads))  # gradients compared too when they had diverged
        _confirmed(result, plan, confirmed, history, repaired)
        return plan
    return None


def _plan(result: AuditResult, resync_src: ResyncSource) -> ResyncPlan | None:
    """Each tensor from a rank holding its reference value (engine/repair/resync_plan.py): the same plan on
    every rank, from the same record; ``None`` (the result raised, with a note why) when nothing may move."""
    structural = [m.name for m in result.mismatches if m.kind == "structure"]
    if structural:
        result.action = "raised"
        result.notes.append(f"resync impossible: the structure differs ({', '.join(structural[:5])})")
        return None
    # On a tie the blame, when it names a rank, decides the source (never the blamed side); a tie with no
    # evidence keeps resync_src and says it was chosen without evidence (engine/culprit.py decides both).
    src, chosen_by = resync_source(result.mismatches, result.blame, resync_src)
    try:
        plan = plan_resync(result.mismatches, src, tie_chosen_by=chosen_by)  # never a source holding NaN/inf
    except ResyncError as exc:  # no finite copy anywhere: nothing moves
        result.action = "raised"
        result.notes.append(f"resync impossible: {exc}")
        return None
    result.notes.extend(plan.notes)
    return plan


def _confirmed(
    result: AuditResult,
    plan: ResyncPlan,
    confirmed: AuditResult,
    history: AuditHistory,
    repaired: Callable[[int | None], None] | None,
) -> None:
    """The action the confirming audit decides; after a confirmed resync, the history restarts and every
    per-step record about the divergence it ended is dropped (pinpoint, attribution, batch digests)."""
    if confirmed.in_sync:
        result.action = "resynced"
        result.notes.append(f"resynced {plan.describe()}; a full audit confirmed the replicas are in sync")
        history.resyncs += 1
        history.last_in_sync_step = result.step
        history.last_full_sync_step = result.step
        if repaired is not None:
            repaired(result.step)  # evidence about the earlier divergence never decides a later one
    else:
        result.action = "raised"
        result.notes.append(f"resync ({plan.describe()}) did not restore agreement: {confirmed.summary()}")


@dataclass
class Voice:
    """What the main process has said so far, so each fact is said once."""

    last_reported: tuple[str, ...] = ()
    """The diverged names last reported: a divergence is printed when it appears or changes."""
    repeats: int = 0
    """Resyncs in a row of the same tensors (the same cause)."""
    escalated: bool = False
    said: dict[str, str] = field(default_factory=dict)
    """Hint texts already said elsewhere (a warning), and where: a report refers to them, not repeats them."""

    def note_said(self, texts: Sequence[str], where: str) -> None:
        """``texts`` were said ``where`` (e.g. "the warning at step 12"): later reports refer to them."""
        for text in texts:
            self.said.setdefault(text, where)

    def _unsaid(self, result: AuditResult) -> AuditResult:
        """``result`` for printing: a hint said before is a reference to it plus what it adds (the record keeps it whole)."""
        hints = []
        for hint in result.hints:
            said = next((t for t in self.said if hint.startswith(t)), None)
            if said is None:
                hints.append(hint)
            else:
                hints.append(f"the cause and its fix are in {self.said[said]} above." + hint[len(said) :])
        return result if hints == result.hints else replace(result, hints=hints)

    def speak(self, result: AuditResult, *, verbose: bool, print_fn: Callable[[Any], None]) -> None:
        """Print ``result`` when it says something new; a persisting cause in one line."""
        if result.in_sync or result.within_tolerance:
            self.last_reported, self.repeats = (), 0
            return
        names = tuple(result.diverged_names)
        same = names == self.last_reported
        self.last_reported = names
        if same and result.action == "resynced":
            self.repeats += 1
            line = f"weightsync audit: {_where(result)}: resynced again, {self.repeats + 1} times, same cause"
            self._say(line, verbose, print_fn)
            if self.repeats + 1 >= ESCALATE_AFTER and not self.escalated:
                self.escalated = True
                warnings.warn(
                    f"weightsync audit: resync repaired the same {len(names)} tensor(s) {self.repeats + 1} times "
                    f"in a row ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): the cause persists and "
                    "resync only hides it; see the hint in the first report"
                    + (f": {result.hints[0].split('. ')[0]}" if result.hints else ""),
                    WeightSyncWarning,
                    stacklevel=user_stacklevel(),
                )
            return
        if same and result.action not in ("raised", "resynced"):
            return
        self.repeats = 0
        if verbose:
            print_fn(self._unsaid(result))
        else:
            log.warning("weightsync audit: %s", result.summary())

    @staticmethod
    def _say(line: str, verbose: bool, print_fn: Callable[[Any], None]) -> None:
        if verbose:
            print_fn(line)
        else:
            log.warning("%s", line)


def _where(result: AuditResult) -> str:
    return "audit" if result.step is None else f"step {result.step}"
