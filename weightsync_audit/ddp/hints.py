"""Why replicas differ: root-cause hints drawn from the mismatches, the wrapper and the optimizer state.

A hint states a cause as fact only when the wrapper proves it (DDP's reducer does not cover the
diverged parameters, or DDP was told to ignore them, or runs with ``forward_sync_buffers=False``,
formerly ``broadcast_buffers=False``); everything inferred from the pattern of mismatches says "likely",
and names no explanation the gathered evidence rules out. Hints come most specific first, each mismatch
feeds at most one parameter hint, and a cause stays named while its mismatches remain (an optimizer cause
is not dropped once the parameters follow it). The wrapper read is the live one: a wrapper a re-wrap
retired is followed to its successor, or not read.

Each cause is one :class:`~weightsync_audit.ddp.hint_rules.Rule` (the evidence it needs, the evidence
that rules it out, its words); :func:`explain` gathers the :class:`~weightsync_audit.ddp.evidence.Evidence`
once and asks every rule in turn.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Sequence

from torch.nn.parallel import DistributedDataParallel

from weightsync_audit.ddp.evidence import Evidence, uses_fsdp2
from weightsync_audit.ddp.hint_engines import ENGINE_RULES
from weightsync_audit.ddp.hint_rules import RULES, Rule, ddp_frozen_hint, ddp_unsynced_hint
from weightsync_audit.ddp.hint_zero import ZERO_RULES
from weightsync_audit.reporting.record import Mismatch

__all__ = ["ORDER", "ddp_frozen_hint", "ddp_unsynced_hint", "explain", "uses_fsdp2"]

ORDER: tuple[Rule, ...] = tuple(x for r in (*ZERO_RULES, *RULES) for x in (*ENGINE_RULES.get(r.cause, ()), r))
"""Every rule in the order :func:`explain` asks them: ZeRO's check first, an engine's variant of a generic
cause just before it."""


def explain(
    mismatches: Sequence[Mismatch],
    *,
    ddp: DistributedDataParallel | None = None,
    synced: frozenset[str] | None = None,
    grads_checked: bool = False,
    params_compared: bool = True,
    module: Any = None,
    drifting: Collection[str] = (),
    drift_hint: Callable[[list[str]], str] | None = None,
    state_names: Collection[str] = (),
    engine: str | None = None,
) -> list[str]:
    """Hints for a set of mismatches, most specific first.

    ``synced``: the parameter names DDP all-reduces when the caller already knows them (for example
    a snapshot taken right after the wrap); otherwise they are read from ``ddp``.
    ``grads_checked``: gradients were part of this audit, so "no grad mismatch" means they agree.
    ``params_compared``: at least one parameter was compared (not so when every shard has no replica),
    so "no param mismatch" means they agree. ``module``: the audited module, to recognise FSDP2.
    ``drifting``: names whose measured gap is the size of float rounding; unless a proven cause above
    accounts for them, ``drift_hint(names)`` explains them instead of the bug-class guesses below.
    ``state_names``: the per-parameter optimizer state entries this audit compared on every rank
    (``0.weight.exp_avg``): what the hints may say of the optimizer, and state stepped from a parameter's
    gradients that agrees rules out unreduced gradients as the cause of that parameter's difference.
    ``engine``: the sharding engine holding the tensors (``"DeepSpeed ZeRO-2"``): its own reduction, not
    DDP's, is then what a differing parameter or gradient is read against.

    >>> explain([Mismatch("param_groups.0.lr", "optimizer", [1], [0])])[0].split(":")[0]
    'The learning rate differs (param_groups.0.lr) while the parameters still agree'
    """
    if not mismatches:
        return []
    ev = Evidence(
        mismatches,
        ddp=ddp,
        synced=synced,
        grads_checked=grads_checked,
        params_compared=params_compared,
        module=module,
        drifting=drifting,
        drift_hint=drift_hint,
        state_names=state_names,
        engine=engine,
    )
    hints: list[str] = []
    for rule in ORDER:  # ZeRO's own check first: the optimizer rules would blame a load
        found = rule.find(ev)
        if found is not None:
            hint, accounted = found
            hints.append(hint)
            ev.explained.update(accounted)
    return hints
