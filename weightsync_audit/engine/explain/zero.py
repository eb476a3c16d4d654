"""The hint for DeepSpeed ZeRO-1/2's local check, ``zero.fp32_master_matches_params``, when it differs.

The check is each rank's own: its slice of the module parameters equals the cast of its fp32 master
partition. A rank where it fails holds parameters the masters did not produce. When parameters differ on
those same ranks, the parameters were changed there after the optimizer step (the masters did not follow),
which is no optimizer state loaded or reset; when none differs there, the master partition itself was
changed, and the next all-gather hands it to every rank, where no comparison can see it any more. Asked
before the optimizer rules of :mod:`~weightsync_audit.engine.explain.rules`, which would otherwise blame a
checkpoint loaded on one rank.

>>> ZERO_RULES[0].cause
'ZeRO parameters no longer match their fp32 master'
"""

from __future__ import annotations

from weightsync_audit.compat_engines import MASTER_CHECK
from weightsync_audit.engine.explain.evidence import Evidence
from weightsync_audit.engine.explain.rules import Names, Rule
from weightsync_audit.text import brief_names

__all__ = ["ZERO_RULES"]


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
