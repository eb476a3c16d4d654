"""The explain phase, why replicas differ: root-cause hints drawn from the mismatches, the wrapper and the
optimizer state, from the :class:`Evidence` an audit gathered (``evidence``) by one rule per cause (``rules``).

A hint states a cause as fact only when the wrapper proves it (DDP's reducer does not cover the
diverged parameters, or DDP was told to ignore them, or runs with ``forward_sync_buffers=False``,
formerly ``broadcast_buffers=False``); everything inferred from the pattern of mismatches says "likely",
and names no explanation the gathered evidence rules out. Hints come most specific first, each mismatch
feeds at most one parameter hint, and a cause stays named while its mismatches remain (an optimizer cause
is not dropped once the parameters follow it). The wrapper read is the live one: a wrapper a re-wrap
retired is followed to its successor, or not read.

Each cause is one :class:`~weightsync_audit.engine.explain.rules.Rule` (the evidence it needs, the evidence
that rules it out, its words); the caller gathers the :class:`~weightsync_audit.engine.explain.evidence.Evidence`
once and :func:`explain` asks every rule in turn (:data:`ORDER`). Two kinds of rule join the generic ones here:

- **DeepSpeed ZeRO-1/2's local check** ``zero.fp32_master_matches_params`` (:data:`ZERO_RULES`, asked first):
  each rank's slice of the module parameters equals the cast of its fp32 master partition. Where it fails
  and parameters differ on the same ranks, they were changed after the optimizer step (no optimizer state
  loaded or reset); where none differs there, the master partition itself was changed, and the next
  all-gather hands it to every rank. Asked before the optimizer rules, which would blame a checkpoint load.
- **A sharding engine's own reduction** (DeepSpeed, FSDP1, a declared layout; :data:`ENGINE_RULES`): the
  generic causes for a differing parameter or gradient name DDP's failure modes; under an engine that
  reduces the gradients itself and no DDP wrapper, its variant speaks instead, asked just before.

>>> from weightsync_audit.reporting.record import Mismatch
>>> ZERO_RULES[0].cause
'ZeRO parameters no longer match their fp32 master'
>>> ev = Evidence([Mismatch("fc.weight", "param", [1], [0])], engine="DeepSpeed ZeRO-2")
>>> ENGINE_RULES["parameters differ"][0].find(ev)[0].split(":")[0]
'Parameters fc.weight differ under DeepSpeed ZeRO-2, which reduces their gradients itself'
"""

from __future__ import annotations

from dataclasses import replace

from weightsync_audit.compat_engines import MASTER_CHECK
from weightsync_audit.engine.explain.evidence import Evidence
from weightsync_audit.engine.explain.rules import RULES, Names, Rule, worded
from weightsync_audit.text import brief_names

__all__ = ["ENGINE_RULES", "ORDER", "ZERO_RULES", "Evidence", "explain"]


def _under_engine(ev: Evidence) -> bool:
    return ev.engine is not None and ev.ddp is None


def _under_an_engine(generic: Rule, words: str) -> Rule:
    """``generic`` read against an engine's own reduction: the same mismatches, ruled out and accounted for
    alike, asked only under an engine without a DDP wrapper, and worded for that engine."""
    return replace(
        generic,
        cause=f"{generic.cause} under a sharding engine",
        needs=lambda ev: generic.needs(ev) if _under_engine(ev) else [],
        says=worded(words),
    )


_WORDS = {
    "gradients differ": (
        "Gradients differ ({names}) under {engine}, which reduces them itself: likely they were changed on some "
        "ranks after its reduction (a hook or manual edit), or computed outside it."
    ),
    "parameters differ": (
        "Parameters {names} differ under {engine}, which reduces their gradients itself: likely they were "
        "loaded, initialised or edited on some ranks only outside the engine (after it set the model up, or "
        "between its steps), or updated from local values (an EMA from local data)."
    ),
}
"""The generic causes an engine speaks for instead, and its words for them."""

ENGINE_RULES: dict[str, tuple[Rule, ...]] = {
    rule.cause: (_under_an_engine(rule, _WORDS[rule.cause]),) for rule in RULES if rule.cause in _WORDS
}
"""Cause of the generic rule -> the rules asked just before it under an engine."""


def _on_same_ranks(ev: Evidence) -> Names:
    """The differing parameters (not yet explained) on the ranks where the master check differs."""
    checks = [m for m in ev.by_kind.get("optimizer", []) if m.name == MASTER_CHECK]
    odd = {r for m in checks for r in m.ranks}
    return [m.name for m in ev.by_kind.get("param", []) if m.name not in ev.explained and odd & set(m.ranks)]


def _says(ev: Evidence, names: Names) -> str:
    params = _on_same_ranks(ev)
    if params:
        return (
            f"DeepSpeed ZeRO's parameters no longer equal the cast of their own rank's fp32 master partition "
            f"({MASTER_CHECK}) on the ranks where {brief_names(params)} differ: likely those parameters were "
            "edited, loaded or initialised on those ranks after the optimizer step, outside DeepSpeed (the "
            "masters did not follow). The next step all-gathers the parameters from the masters and overwrites "
            "the change, after that step's forward has used it."
        )
    return (
        f"DeepSpeed ZeRO's parameters no longer equal the cast of a rank's own fp32 master partition "
        f"({MASTER_CHECK}) while no parameter differs on those ranks: likely that master partition was changed outside the "
        "optimizer (loaded or edited on that rank only). The next step's all-gather hands it to every rank, "
        "after which no comparison can see it: reload the optimizer state from a checkpoint."
    )


ZERO_RULES: tuple[Rule, ...] = (
    Rule(
        "ZeRO parameters no longer match their fp32 master",
        needs=lambda ev: [n for n in ev.open("optimizer") if n == MASTER_CHECK],
        says=_says,
        accounts=lambda ev, names: [*names, *_on_same_ranks(ev)],
    ),
)


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
