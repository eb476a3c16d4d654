"""What each step read and trained on, locally, kept per step until the audit that covers it: the hyper-parameters
each optimizer step read (:class:`StepHyper`), the batch each audited step trained on (:class:`BatchRecords`), and a
step that changed nothing (:class:`StallWatch`).

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

Duplicate batches, data-parallel ranks that trained on identical batches at a step: off by default
(``check_batches=True`` on ``LoopAudit`` or the Lightning callback turns it on, ``AuditConfig.check_batches``).
At an audited step every rank digests its own batch (xxh3-64 over every tensor's exact bytes, in order, with
dtype and shape) into its auditor's :class:`BatchRecords`; the audit that covers the step, synchronous or
overlapped, takes that digest into its context and one round of the audit channel gathers them: ranks
whose digests are equal trained on the same samples, which silently divides the effective data by the
number of ranks sharing it (a sampler without ``rank=``, a resume that restored rank 0's shard on every
rank). The same finding on every rank, from the same data.

>>> import torch
>>> ring = StepHyper()
>>> ring.record(3, [torch.optim.SGD([torch.zeros(1)], lr=0.1)])
>>> ring.covering(3)[3]["param_groups.0.lr"], ring.covering(2)
(0.1, {})
>>> import pickle  # a callback that holds it is pickled by ddp_spawn
>>> pickle.loads(pickle.dumps(ring)).covering(3) == ring.covering(3)
True
>>> shared_batches(Comm(None, 60.0), batch_digest({"x": torch.ones(2)}))  # one rank: nothing to compare
[]
"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
import threading
from typing import Any, Sequence

import xxhash

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.checkpoints.sidecar import flat_tensors
from weightsync_audit.engine.hashing.digest import digest_tensors
from weightsync_audit.errors import warn_user
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import BEFORE_STEP, majority

__all__ = ["BatchRecords", "StallWatch", "StepHyper", "batch_digest", "describe", "hyper_values", "shared_batches"]
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


def batch_digest(batch: Any) -> str | None:
    """16 hex digits over every tensor of ``batch`` (any nesting), or ``None`` when it holds no tensor."""
    flat = flat_tensors(batch)
    if not flat:
        return None
    host = [t.detach() if t.device.type == "cpu" else t.detach().cpu() for t in flat.values()]
    digests = digest_tensors(host, method="xxh3").tolist()  # the audit's own digest: threaded, no copy
    h = xxhash.xxh3_64()
    for (name, t), d in zip(flat.items(), digests):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:{int(d)};".encode())
    return f"{h.intdigest():016x}"


class BatchRecords:
    """This rank's batch digests, one per audited step, owned by its auditor: the audit that covers a step
    consumes that step's digest (and drops any older one), and a confirmed repair clears them."""

    def __init__(self) -> None:
        self.by_step: dict[int, str | None] = {}
        self.said: set[tuple[tuple[int, ...], ...]] = set()
        """Groupings already warned about (once each, on the group's first rank)."""

    def record(self, step: int, batch: Any) -> None:
        """Digest ``batch``, the one trained at ``step`` (local, no message)."""
        self.by_step[int(step)] = batch_digest(batch)

    def take(self, step: int | None) -> str | None:
        """The digest recorded for ``step`` (None: none), consumed with every older one."""
        if step is None:
            return None
        digest = self.by_step.pop(int(step), None)
        for old in [s for s in self.by_step if s < step]:
            del self.by_step[old]
        return digest

    def clear(self) -> None:
        """Forget every digest (a repair made the replicas equal: what came before is no one's evidence)."""
        self.by_step.clear()

    def warn_new(self, groups: list[list[int]], step: int) -> None:
        """Warn once per grouping (call it on one rank)."""
        key = tuple(tuple(g) for g in groups)
        if key not in self.said:
            self.said.add(key)
            warn_user(f"weightsync: {describe(groups, step)}")


def shared_batches(comm: Comm, digest: str | None) -> list[list[int]]:
    """The groups of ranks (global, each of two or more) whose batch digests are equal; collective over
    ``comm`` (one round) when it has more than one rank, the same on every rank."""
    if comm.world_size < 2:
        return []
    digests = [json.loads(p) for p in comm.exchange_bytes(json.dumps(digest).encode(), "the batch digests")]
    by: dict[str, list[int]] = {}
    for g, d in zip(comm.global_ranks, digests):
        if d is not None:
            by.setdefault(d, []).append(g)
    return sorted(sorted(rs) for rs in by.values() if len(rs) > 1)


def describe(groups: list[list[int]], step: int) -> str:
    """One line: ``ranks 0, 1 trained on identical batches at step 4 (...)``.

    >>> describe([[0, 1]], 4)
    'ranks 0, 1 trained on identical batches at step 4: the effective data is divided by 2 there (a sampler without rank=, or one shard restored on every rank?)'
    """
    parts = "; ".join("ranks " + ", ".join(map(str, g)) for g in groups)
    most = max(len(g) for g in groups)
    return (
        f"{parts} trained on identical batches at step {step}: the effective data is divided by {most} there "
        "(a sampler without rank=, or one shard restored on every rank?)"
    )
