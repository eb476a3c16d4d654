"""What each optimizer step read and did, locally: the hyper-parameters it read, kept per step until the audit
that covers it (:class:`StepHyper`), and a step that changed nothing (:class:`StallWatch`).

A learning rate set differently on one rank for one step parts the parameters at that step, and a
scheduler sets it equal again right after (the Hugging Face Trainer steps it before ``on_step_end``): the
audit after the step finds the parameters apart, the optimizer state stepped from the (all-reduced)
gradients equal, and the ``lr`` equal. The only witness is the ``lr`` as the step read it, visible before
the step (``on_pre_optimizer_step``, Lightning's ``on_before_optimizer_step``). :class:`StepHyper` keeps
it, locally, per step; a divergent audit exchanges the steps it covers (one message, JSON) and every rank
names the same hyper-parameters that differed at a step (:meth:`StepHyper.differed`), as ``optimizer``
mismatches whose ``detail`` says at which step (:data:`~weightsync_audit.text.BEFORE_STEP`), so the hint
names the learning rate. What it found stays the evidence of the divergence in front of it until the
replicas agree again or a resync is confirmed (:meth:`StepHyper.forget`).

A step that changed nothing: with ``pinpoint=True`` each optimizer step's digest is at hand, so a rank whose
audited tensors are bit for bit the same after a step as before it, while its learning rate is not zero, is
told so (a model frozen by mistake: ``requires_grad`` off, gradients zeroed after backward, an optimizer over
other parameters). Local to the rank, a warning only: no message, nothing collective.

>>> import torch
>>> ring = StepHyper()
>>> ring.record(3, [torch.optim.SGD([torch.zeros(1)], lr=0.1)])
>>> ring.covering(3)[3]["param_groups.0.lr"], ring.covering(2)
(0.1, {})
>>> import pickle  # a callback that holds it is pickled by ddp_spawn
>>> pickle.loads(pickle.dumps(ring)).covering(3) == ring.covering(3)
True
"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
import threading
from typing import Any, Sequence

from weightsync_audit.errors import warn_user
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import BEFORE_STEP, majority

__all__ = ["hyper_values", "StallWatch", "StepHyper"]
_KEPT = 1024
"""Steps kept between two audits (the oldest dropped first): a cadence longer than that sees the last ones."""


def hyper_values(optimizers: Sequence[Any], exclude: Sequence[str] = ()) -> dict[str, float | int | bool]:
    """Every group's scalar hyper-parameters (``lr``, ``momentum``...), named as the audit names them
    (``param_groups.0.lr``; ``optimizers.1.param_groups.0.lr`` with several optimizers)."""
    out: dict[str, float | int | bool] = {}
    multi = len(optimizers) > 1
    for oi, opt in enumerate(optimizers):
        prefix = f"optimizers.{oi}." if multi else ""
        for gi, group in enumerate(getattr(opt, "param_groups", ())):
            for key, value in group.items():
                name = f"{prefix}param_groups.{gi}.{key}"
                if isinstance(value, (bool, int, float)) and not any(fnmatch.fnmatchcase(name, p) for p in exclude):
                    out[name] = value
    return out


_DTYPES = {"bool": "bool", "int": "int64", "float": "float64"}
"""The dtype a Python value is audited as (:func:`~weightsync_audit.engine.inventory.manifest.value_as_tensor`)."""


def _key(value: Any) -> str:
    return f"{type(value).__name__}:{value!r}"  # exact: 0.1 and 0.1000000001 differ, NaN equals NaN


def _gap(values: Sequence[Any], odd: Sequence[int], ref: Any) -> tuple[float | None, float | None]:
    try:
        gap = max(abs(float(values[r]) - float(ref)) for r in odd)
    except (TypeError, ValueError):  # a rank lacks the key
        return None, None
    if not math.isfinite(gap):
        return None, None
    return gap, (gap / abs(float(ref)) if float(ref) else None)


class StepHyper:
    """Per optimizer step, the hyper-parameters it read (local); what a divergent audit found in them."""

    def __init__(self, exclude: Sequence[str] = ()) -> None:
        self.exclude = tuple(exclude)
        self._steps: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()  # an overlapped audit reads on its worker while the next step records
        self.found: dict[str, Mismatch] = {}
        """Hyper-parameters that differed at a step since the replicas last agreed (by name): every rank's alike."""

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the callback that holds it: not its lock
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def record(self, step: int, optimizers: Sequence[Any]) -> None:
        """The hyper-parameters optimizer step ``step`` is about to read (call right before it; again after a
        repair of them, which they then read instead)."""
        values = hyper_values(optimizers, self.exclude)
        with self._lock:
            self._steps.pop(step, None)
            self._steps[step] = values
            while len(self._steps) > _KEPT:
                del self._steps[next(iter(self._steps))]

    def covering(self, step: int | None) -> dict[int, dict[str, Any]]:
        """The steps an audit at ``step`` covers (every one kept, without a step)."""
        with self._lock:
            return {s: v for s, v in self._steps.items() if step is None or s <= step}

    def differed(self, comm: Any, step: int | None, current: Sequence[Mismatch]) -> list[Mismatch]:
        """Collective (every rank of a divergent audit calls it): the hyper-parameters that differed across
        ranks at a step this audit covers and are not among its ``current`` mismatches, the first step each;
        ranks are positions in ``comm``'s group, as the audit's own are before it settles them."""
        mine = json.dumps(sorted(self.covering(step).items())).encode()
        every = [dict((int(s), v) for s, v in json.loads(b)) for b in comm.exchange_bytes(mine, "the step hyper")]
        ranks = list(comm.global_ranks)
        taken = {m.name for m in current} | set(self.found)
        for s in sorted(set.intersection(*(set(e) for e in every))):
            names = dict.fromkeys(n for e in every for n in e[s])
            for name in names:
                if name in taken:
                    continue
                values = [e[s].get(name) for e in every]
                ref, odd = majority([_key(v) for v in values])
                if not odd:
                    continue
                taken.add(name)
                sides = "; ".join(f"rank {ranks[r]}: {values[r]!r}" for r in [*odd, ref[0]])
                gap, rel = _gap(values, odd, values[ref[0]])
                self.found[name] = Mismatch(
                    name, "optimizer", odd, ref, [], _DTYPES.get(type(values[ref[0]]).__name__), gap,
                    f"{BEFORE_STEP} {s} read it ({sides}); the same on every rank again when audited",
                    rel_diff=rel,
                )  # fmt: skip
        return copy.deepcopy(list(self.found.values()))  # the audit settles its own copies

    def consumed(self, step: int | None, in_sync: bool) -> None:
        """After an audit at ``step``: the steps it covered are dropped; replicas in agreement forget what was
        found (it was about a divergence that is over)."""
        with self._lock:
            for s in [s for s in self._steps if step is None or s <= step]:
                del self._steps[s]
        if in_sync:
            self.found.clear()

    def forget(self) -> None:
        """A confirmed repair: what was found is about a divergence that is over."""
        self.found.clear()


def _largest_lr(optimizers: Sequence[Any]) -> float:
    lrs = [g.get("lr", 0.0) for opt in optimizers for g in getattr(opt, "param_groups", ())]
    values = [float(x) for x in lrs if isinstance(x, (int, float)) or hasattr(x, "item")]
    return max(values, default=0.0)


class StallWatch:
    """Compares each step's digest with the previous step's; warns once per stretch of unchanged steps."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.previous: tuple[int, int] | None = None
        self.warned = False

    def check(self, step: int, digest: int | None, optimizers: Sequence[Any]) -> str | None:
        """The warning given for ``step`` (``None`` when the weights moved, lr is zero, or already said)."""
        if digest is None:
            self.previous = None
            return None
        previous, self.previous = self.previous, (step, digest)
        if previous is None or step <= previous[0] or previous[1] != digest:
            self.warned = False
            return None
        lr = _largest_lr(optimizers)
        if self.warned or lr <= 0:
            return None
        self.warned = True
        text = (
            f"weightsync: on rank {self.rank} nothing audited changed over optimizer step {step} although lr={lr:g}: "
            "a model frozen by mistake? (requires_grad off, gradients zeroed after backward, an optimizer over "
            "other parameters)"
        )
        warn_user(text)  # the user's loop, not ours
        return text
