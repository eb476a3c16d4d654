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

from weightsync_audit.engine.explain.evidence import Evidence
from weightsync_audit.engine.explain.rules import Names, Rule
from weightsync_audit.text import brief_names

__all__ = ["ENGINE_RULES"]


def _under_engine(ev: Evidence) -> bool:
    return ev.engine is not None and ev.ddp is None


def _say_params(ev: Evidence, names: Names) -> str:
    return (
        f"Parameters {brief_names(names)} differ under {ev.engine}, which reduces their gradients itself: "
        "likely they were loaded, initialised or edited on some ranks only outside the engine (after it set "
        "the model up, or between its steps), or updated from local values (an EMA from local data)."
    )


def _say_grads(ev: Evidence, names: Names) -> str:
    return (
        f"Gradients differ ({brief_names(names)}) under {ev.engine}, which reduces them itself: likely they "
        "were changed on some ranks after its reduction (a hook or manual edit), or computed outside it."
    )


ENGINE_RULES: dict[str, tuple[Rule, ...]] = {
    "gradients differ": (
        Rule(
            "gradients differ under a sharding engine",
            needs=lambda ev: ev.open("grad") if _under_engine(ev) else [],
            says=_say_grads,
            accounts=lambda ev, names: (),
        ),
    ),
    "parameters differ": (
        Rule(
            "parameters differ under a sharding engine",
            needs=lambda ev: ev.open("param") if _under_engine(ev) else [],
            says=_say_params,
            ruled_out=lambda ev, names: bool(ev.open("grad")),  # the gradients' hint says it
        ),
    ),
}
"""Cause of the generic rule -> the rules asked just before it under an engine."""
