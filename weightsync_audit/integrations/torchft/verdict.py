"""The record of an audit across replica groups: the engine's result, completed with what torchft adds.

The engine compared the tensors. What a healed replica also needs is the same *position* in training: the
Manager's step and committed batches, the lr scheduler's state (``last_epoch``, ``_step_count``, its base
and last lrs), and whatever else the user declares with ``must_match`` (an EMA's step, a curriculum's
stage). These few small values ride each member's roll entry (:func:`collect`), so every member compares
the same gathered values with the library's vote (:func:`compare`; kind ``optimizer`` for the Manager's and
the scheduler's counters, ``buffer`` for declared state).

:func:`complete` adds them to the record with its ``torchft`` field (the quorum, the replicas compared and
those absent, the heals verified, the sync point) and the notes and hints that say it in words: above all,
for a replica that healed at this step, whether it equals its source before its first committed step, and
if not, what the heal left different and where that state should have come from. A heal's evidence ends
there: after a LocalSGD/DiLoCo sync, a difference in the synced parameters is the sync's.

>>> values = [{"lr_scheduler.last_epoch": ["optimizer", 5]}, {"lr_scheduler.last_epoch": ["optimizer", 0]}]
>>> [(m.name, m.ranks, m.detail) for m in compare(values, (0, 1))[0]]
[('lr_scheduler.last_epoch', [1], 'rank 1 holds 0, rank 0 holds 5')]
>>> [h.split(" differs")[0] for h in heal_hints(["fc.weight.exp_avg", "lr_scheduler.last_epoch"], {})]
["The healed replica's optimizer state (fc.weight.exp_avg)", "The healed replica's lr scheduler (lr_scheduler.last_epoch)"]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from weightsync_audit.engine.hashing.digest import digest_tensor
from weightsync_audit.integrations.torchft.channel import Roll
from weightsync_audit.reporting.record import AuditResult, Mismatch
from weightsync_audit.text import TIE_PREFIX, brief_names, is_tie, majority

__all__ = ["AuditPoint", "collect", "compare", "complete", "heal_hints"]


def _plain(value: Any) -> Any:
    """``value`` as JSON (a tensor by its dtype, shape and exact digest); ``None`` when it cannot be."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "digest": digest_tensor(t)}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if isinstance(value, Mapping):
        out = {str(k): _plain(v) for k, v in value.items()}
        return None if any(out[str(k)] is None and v is not None for k, v in value.items()) else out
    return None


def collect(
    manager: Any, lr_scheduler: Any = None, must_match: Mapping[str, Callable[[], Any]] | None = None
) -> tuple[dict[str, list[Any]], list[str]]:
    """This replica's counters, name -> ``[kind, JSON value]``, and the names it could not express."""
    out: dict[str, list[Any]] = {
        "torchft.manager.step": ["optimizer", int(manager.current_step())],
        "torchft.manager.batches_committed": ["optimizer", int(manager.batches_committed())],
    }
    skipped: list[str] = []
    schedulers = lr_scheduler if isinstance(lr_scheduler, (list, tuple)) else [lr_scheduler] if lr_scheduler else []
    for i, sched in enumerate(schedulers):
        prefix = "lr_scheduler" if len(schedulers) == 1 else f"lr_scheduler.{i}"
        for key, value in sorted(sched.state_dict().items()):
            plain = _plain(value)
            if plain is None and value is not None:
                skipped.append(f"{prefix}.{key}")  # a closure (LambdaLR's lr_lambdas): not comparable
            else:
                out[f"{prefix}.{key}"] = ["optimizer", plain]
    for name, read in (must_match or {}).items():
        value = read()
        plain = _plain(value)
        if plain is None and value is not None:
            raise TypeError(
                f"must_match[{name!r}] returned a {type(value).__name__}: give numbers, strings, tensors, "
                "or lists and dicts of them"
            )
        out[name] = ["buffer", plain]
    return out, skipped


def _gap(values: Sequence[Any], ref: Any) -> float | None:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(nums) != len(values) or not isinstance(ref, (int, float)) or isinstance(ref, bool):
        return None
    return float(max(abs(v - ref) for v in nums))


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def compare(per_member: Sequence[Mapping[str, list[Any]]], ranks: Sequence[int]) -> tuple[list[Mismatch], int]:
    """The counters that differ among the members (``ranks``: their replica ranks, in position order), and
    how many were compared. A counter some members lack is a ``structure`` mismatch naming them."""
    names = sorted({n for values in per_member for n in values})
    texts = [json.dumps(values, sort_keys=True) for values in per_member]
    if len(set(texts)) <= 1:  # the healthy audit's case, by the same JSON: nothing to vote on
        return [], len(names)
    mismatches: list[Mismatch] = []
    for name in names:
        holders = [i for i, values in enumerate(per_member) if name in values]
        kind = next(per_member[i][name][0] for i in holders)
        if len(holders) < len(per_member):
            lacking = [ranks[i] for i in range(len(per_member)) if i not in holders]
            mismatches.append(
                Mismatch(
                    name,
                    "structure",
                    lacking,
                    [ranks[i] for i in holders],
                    detail=f"missing on rank(s) {lacking}",
                )
            )
            continue
        values = [per_member[i][name][1] for i in holders]
        ref_pos, odd_pos = majority([json.dumps(v, sort_keys=True) for v in values])
        if not odd_pos:
            continue
        ref = values[ref_pos[0]]
        odd = [values[i] for i in odd_pos]
        shown = ", ".join(f"rank {ranks[i]} holds {_show(values[i])}" for i in odd_pos)
        mismatches.append(
            Mismatch(
                name,
                kind,
                [ranks[i] for i in odd_pos],
                [ranks[i] for i in ref_pos],
                shape=[],
                dtype=type(ref).__name__,
                max_abs_diff=_gap(odd, ref),
                detail=f"{shown}, rank {ranks[ref_pos[0]]} holds {_show(ref)}",
            )
        )
    return mismatches, len(names)


_KIND_WORDS = {"params": "parameters", "buffers": "buffers", "optimizer": "optimizer state"}


@dataclass(frozen=True)
class AuditPoint:
    """Where an audit ran: what the record's ``torchft`` field and notes say besides the roll."""

    quorum_id: int
    group_rank: int
    point: str
    """``step`` (before a committed optimizer step) or ``sync`` (right after a LocalSGD/DiLoCo sync)."""
    step: int
    include: tuple[str, ...]
    timeout_s: float
    sync: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    per_replica: tuple[str, ...] = ()
    model_names: frozenset[str] = frozenset()
    """The model's parameter and buffer names (a missing one is the model's, not the optimizer's)."""


def _cause(name: str, kind: str, model_names: frozenset[str]) -> str:
    if name.startswith("torchft.manager."):
        return "manager"
    if name.startswith("lr_scheduler"):
        return "scheduler"
    if kind == "buffer" and name not in model_names:
        return "declared"
    return "model" if kind in ("param", "buffer") or name in model_names else "optimizer"


def heal_hints(names: Sequence[str], kinds: Mapping[str, str], model_names: frozenset[str] = frozenset()) -> list[str]:
    """What a heal left different, by where that state should have come from (``kinds``: name -> mismatch
    kind; ``model_names``: the model's parameters and buffers, which tell a missing one from optimizer state)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(_cause(name, kinds.get(name, ""), model_names), []).append(name)
    said = {
        "optimizer": "The healed replica's optimizer state ({}) differs from its source's: the load_state_dict "
        "handed to the torchft Manager does not restore the optimizer (the state_dict must carry "
        "optimizer.state_dict() and load_state_dict must call optimizer.load_state_dict).",
        "scheduler": "The healed replica's lr scheduler ({}) differs from its source's: the state torchft sends a "
        "healing replica does not carry the scheduler, or its load_state_dict does not load it; restore it "
        "there (or manager.register_state_dict_fn('lr_scheduler', sched.load_state_dict, sched.state_dict)).",
        "manager": "The healed replica's Manager counters ({}) differ from its source's: torchft restores them "
        "itself, so the heal did not complete (see torchft's errors log).",
        "model": "The healed replica's {} differ from its source's: the model state the Manager sends or loads "
        "leaves them out (a load_state_dict with strict=False, a buffer not in state_dict, state outside the "
        "model), or it changed while it was sent.",
        "declared": "Declared state ({}) differs on the healed replica: its heal does not restore it.",
    }
    return [said[key].format(brief_names(group, 5)) for key, group in groups.items()]


def _heal_report(result: AuditResult, roll: Roll, at: AuditPoint, compared: str) -> dict[str, Any]:
    healed: dict[str, Any] = {}
    for member in roll.members:
        if not member.healed:
            if member.source is not None:  # its evidence ended at the sync: not verified, never blamed
                result.notes.append(
                    f"replica {member.replica_rank} ({member.replica_id}) healed from replica {member.source} "
                    "before this sync; the sync replaced what the heal loaded, so this audit checks the sync"
                )
            continue
        r = member.replica_rank
        differs = [m.name for m in result.mismatches if r in m.ranks]
        src = member.source
        healed[str(r)] = {"source": src, "verified": not differs, "differs": differs[:50]}
        who = f"replica {r} ({member.replica_id})"
        if not differs:
            result.notes.append(
                f"{who} healed from replica {src} at step {at.step}: verified before its first committed step, "
                f"{compared} equal its source's"
            )
            continue
        result.notes.append(
            f"{who} healed from replica {src} at step {at.step} and differs from it before its first committed "
            f"step: {brief_names(differs, 8)}"
        )
        kinds = {m.name: m.kind for m in result.mismatches}
        # The heal's own words first: they say where the state should have come from.
        result.hints[:0] = [h for h in heal_hints(differs, kinds, at.model_names) if h not in result.hints]
    return healed


def _blame_heal(result: AuditResult, roll: Roll, step: int) -> None:
    """A divergence only healed replicas hold, against their sources: the heal is to blame, not a tie.

    With two replicas the vote between a healed replica and its source is a tie; the roll put the source
    first, so it is the reference, and the record says why instead of 'no majority'."""
    sources = {m.replica_rank: m.source for m in roll.members if m.healed and m.source is not None}
    odd = {r for m in result.mismatches for r in m.ranks}
    if not odd or not odd <= set(sources):
        return
    for m in result.mismatches:
        if is_tie(m.detail) and any(sources[r] in m.reference_ranks for r in m.ranks):
            before = str(m.detail).split(TIE_PREFIX + ":")[0].rstrip("; ")
            why = f"the healed replica against its source (replica {', '.join(str(sources[r]) for r in m.ranks)})"
            m.detail = f"{before}; {why}" if before else why
    result.blame = {
        "ranks": sorted(odd),
        "evidence": "deterministic_difference",
        "cause": "a software difference",
        "hardware_suspect": False,
        "step": step,
        "detail": "; ".join(f"replica {r} healed from replica {sources[r]} and differs from it" for r in sorted(odd))
        + ": the state torchft sent, or the load_state_dict that applied it, left these out",
    }


def _blame_sync(result: AuditResult, at: AuditPoint) -> None:
    """Right after a committed sync the parameters are the all-reduce's result: a difference there is the
    sync's (the vote names the odd replicas; a tie, no one), not the vote's guess or a heal's."""
    params = [m for m in result.mismatches if m.kind == "param"]
    if at.sync is None or not params or (result.blame or {}).get("evidence") not in (None, "vote", "undecided"):
        return
    odd = sorted({r for m in params if not is_tie(m.detail) for r in m.ranks})
    who = f"on replica(s) {odd}" if odd else "with no majority, so no replica alone is named"
    result.blame = {
        "ranks": odd,
        "evidence": "collective_mismatch",
        "cause": "the collective",
        "hardware_suspect": False,
        "step": at.step,
        "detail": f"the {at.sync['algorithm']} sync committed at step {at.step} left the synced parameters "
        f"({brief_names([m.name for m in params], 5)}) different {who}: the all-reduce gave other bytes, or a "
        "replica did not take part in it as the others did",
    }


def complete(result: AuditResult, roll: Roll, at: AuditPoint, skipped: Sequence[str]) -> None:
    """Add the counters, the ``torchft`` field, the notes and hints to ``result`` (the same on every member)."""
    found, compared_counters = compare([m.counters for m in roll.members], roll.ranks)
    kinds = {n: v[0] for m in roll.members for n, v in m.counters.items()}
    for kind in ("optimizer", "buffer"):
        result.checked[kind] = result.checked.get(kind, 0) + sum(1 for k in kinds.values() if k == kind)
    if found:
        result.mismatches.extend(found)
        result.in_sync = False
    # From the roll's first member, not this process's history: a replica that just joined has none.
    first = roll.members[0]
    result.last_in_sync_step = at.step if result.in_sync else first.last_in_sync_step
    result.last_full_sync_step = at.step if result.in_sync and not result.coverage else first.last_full_sync_step
    what = [_KIND_WORDS[k] for k in ("params", "buffers", "optimizer") if k in at.include]
    counters = sorted({n.split(".")[0] for n in kinds if not n.startswith("torchft.")})
    compared = ", ".join(what) + ", the Manager's step and committed batches" + "".join(f", {c}" for c in counters)
    healed = _heal_report(result, roll, at, compared)
    _blame_heal(result, roll, at.step)
    _blame_sync(result, at)
    if roll.absent:
        result.notes.append(
            f"replica(s) {list(roll.absent)} of quorum {at.quorum_id} did not come to this audit within "
            f"{at.timeout_s:g}s (no committed step here, or gone): not compared"
        )
    if at.per_replica:
        result.notes.append(f"not compared, per replica by design: {', '.join(at.per_replica)}")
    if skipped:
        result.notes.append(f"not compared (not plain values): {', '.join(skipped)}")
    result.notes.extend(at.notes)
    result.notes.append(f"{compared_counters} step counter(s) and declared value(s) compared through the quorum")
    field: dict[str, Any] = {
        "quorum_id": at.quorum_id,
        "group_rank": at.group_rank,
        "point": at.point,
        "replicas": {str(m.replica_rank): m.replica_id for m in roll.members},
        "absent": list(roll.absent),
        "healed": healed,
    }
    if at.sync is not None:
        field["sync"] = dict(at.sync, between_syncs="not audited")
    result.torchft = field
