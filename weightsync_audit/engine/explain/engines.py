"""Hints under a sharding engine (DeepSpeed, FSDP1, a declared layout): its own reduction, not DDP's.

The generic causes of :mod:`~weightsync_audit.engine.explain.rules` for a differing parameter or gradient name
DDP's failure modes (a trainable set changed after the wrap, ``no_sync()`` misuse, no wrapper at all).
Under an engine that reduces the gradients itself those are not the causes; these rules speak instead,
asked just before the generic one they replace (:data:`ENGINE_RULES`), and only when the evidence names
an engine and no DDP wrapper.

>>> from weightsync_audit.engine.explain.evidence import Evidence
>>> from weightsync_audit.reporting.record import Mismatch
>>> ev = Evidence([Mismatch("fc.weight", "param", [1], [0])], engine="DeepSpeed ZeRO-2")
>>> ENGINE_RULES["parameters differ"][0].find(ev)[0].split(":")[0]
'Parameters fc.weight differ under DeepSpeed ZeRO-2, which reduces their gradients itself'
"""

from __future__ import annotations

from dataclasses import replace

from weightsync_audit.engine.explain.evidence import Evidence
from weightsync_audit.engine.explain.rules import RULES, Rule, worded

__all__ = ["ENGINE_RULES"]


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
