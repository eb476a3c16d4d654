"""Why replicas differ: root-cause hints drawn from the mismatches, the wrapper and the optimizer state.

A hint states a cause as fact only when the wrapper proves it (DDP's reducer does not cover the
diverged parameters, or DDP was told to ignore them, or runs with ``forward_sync_buffers=False``,
formerly ``broadcast_buffers=False``); everything inferred from the pattern of mismatches says "likely",
and names no explanation the gathered evidence rules out. Hints come most specific first, each mismatch
feeds at most one parameter hint, and a cause stays named while its mismatches remain (an optimizer cause
is not dropped once the parameters follow it). The wrapper read is the live one: a wrapper a re-wrap
retired is followed to its successor, or not read.

Each cause is one :class:`~weightsync_audit.engine.explain.rules.Rule` (the evidence it needs, the evidence
that rules it out, its words); the caller gathers the :class:`~weightsync_audit.engine.explain.evidence.Evidence`
once and :func:`explain` asks every rule in turn.
"""

from __future__ import annotations

from weightsync_audit.engine.explain.engines import ENGINE_RULES
from weightsync_audit.engine.explain.evidence import Evidence
from weightsync_audit.engine.explain.rules import RULES, Rule
from weightsync_audit.engine.explain.zero import ZERO_RULES

__all__ = ["ORDER", "explain"]

ORDER: tuple[Rule, ...] = tuple(x for r in (*ZERO_RULES, *RULES) for x in (*ENGINE_RULES.get(r.cause, ()), r))
"""Every rule in the order :func:`explain` asks them: ZeRO's check first, an engine's variant of a generic
cause just before it."""


def explain(evidence: Evidence) -> list[str]:
    """Hints for the mismatches of ``evidence``, most specific first (none when nothing differs).

    The evidence is read as gathered (see :class:`~weightsync_audit.engine.explain.evidence.Evidence` for
    what each of its facts lets the rules say); its ledger of explained names fills as the rules speak,
    so one :class:`Evidence` serves one call.

    >>> from weightsync_audit.reporting.record import Mismatch
    >>> explain(Evidence([Mismatch("param_groups.0.lr", "optimizer", [1], [0])]))[0].split(":")[0]
    'The learning rate differs (param_groups.0.lr) while the parameters still agree'
    """
    hints: list[str] = []
    if not evidence.mismatches:
        return hints
    for rule in ORDER:  # ZeRO's own check first: the optimizer rules would blame a load
        found = rule.find(evidence)
        if found is not None:
            hint, accounted = found
            hints.append(hint)
            evidence.explained.update(accounted)
    return hints
