"""The campaign's ground truth: exact bytes of everything audited, per rank and step, and the scoring.

Independent of the library: the snapshot is the raw bytes of every tensor (``numpy().tobytes()``, dtype
and shape included), the exact bits of Python floats (``float.hex``), and each parameter's
``requires_grad`` flag; nothing from ``weightsync_audit`` is used. Ranks hold the same value only when
these bytes are equal. The reference group follows the contract's rule (the largest group of equal
values, a tie to the group holding the lowest rank), so the ranks the tool should name are known.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import nn

Snapshot = dict[str, bytes]


def _value_bytes(v: Any) -> bytes:
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        return f"{t.dtype}{list(t.shape)}".encode() + t.numpy().tobytes()
    if isinstance(v, float):
        return b"float" + v.hex().encode()
    if isinstance(v, (tuple, list)):
        return repr(type(v)).encode() + b"|".join(_value_bytes(x) for x in v)
    return repr(type(v)).encode() + repr(v).encode()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> Snapshot:
    """Every audited value's exact bytes, named as the audit names them (``0.weight.exp_avg``,
    ``param_groups.0.lr``); a parameter's trainable flag under ``NAME.requires_grad``."""
    out: Snapshot = {}
    names = {}
    for n, p in model.named_parameters():
        names[id(p)] = n
        out[n] = _value_bytes(p)
        out[f"{n}.requires_grad"] = b"1" if p.requires_grad else b"0"
    for n, b in model.named_buffers():
        out[n] = _value_bytes(b)
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            for key, v in opt.state.get(p, {}).items():
                out[f"{names[id(p)]}.{key}"] = _value_bytes(v)
        for key, v in group.items():
            if key != "params":
                out[f"param_groups.{gi}.{key}"] = _value_bytes(v)
    return out


HELD = "fsdp1.optimizer_state_held."
"""FSDP1: whether a rank's optimizer holds state for a sharded parameter (the state has no replica)."""


def snapshot_fsdp1(fsdp: nn.Module, opt: torch.optim.Optimizer) -> Snapshot:
    """Under FSDP1 FULL_SHARD: the full parameters (gathered by ``summon_full_params``: collective, every
    rank calls it), the buffers, the hyper-parameters, and per sharded parameter whether this rank's
    optimizer holds state for it (``fsdp1.optimizer_state_held.<name>``) and its scalar state (``step``):
    a state tensor of a shard is one rank's piece, with no replica, so it is no fact to compare."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out: Snapshot = {}
    with FSDP.summon_full_params(fsdp, writeback=False):
        for n, p in fsdp.named_parameters():
            out[n] = _value_bytes(p.detach().clone())  # a copy: FSDP frees the gathered storage on exit
    names = {id(p): n.replace("_fsdp_wrapped_module.", "") for n, p in fsdp.named_parameters()}
    for n, b in fsdp.named_buffers():
        out[n.replace("_fsdp_wrapped_module.", "")] = _value_bytes(b)
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            state = opt.state.get(p, {})
            out[HELD + names[id(p)]] = b"1" if state else b"0"
            for key, v in state.items():
                if not (isinstance(v, torch.Tensor) and v.dim() > 0):
                    out[f"{names[id(p)]}.{key}"] = _value_bytes(v)
        for key, v in group.items():
            if key != "params":
                out[f"param_groups.{gi}.{key}"] = _value_bytes(v)
    return out


def _held_only(n: str, snaps: list[Snapshot]) -> bool:
    """``n`` is the scalar state of an FSDP1-sharded parameter: compared among the ranks holding state only
    (its presence is the ``fsdp1.optimizer_state_held`` fact)."""
    return any(HELD + n.rsplit(".", 1)[0] in s for s in snaps)


EXPERT_GROUP = "__expert_group__"
"""In an expert run's snapshot: which expert group the rank belongs to (its experts, ``3.*``, are compared
within the group; the key itself differs by design and is no fact)."""


def odd_ranks(values: list[bytes]) -> list[int]:
    """The ranks outside the reference group: the largest group of equal bytes, a tie to the lowest rank."""
    groups: dict[bytes, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    ref = max(groups.values(), key=lambda rs: (len(rs), -rs[0]))
    return [r for r in range(len(values)) if r not in ref]


def diverged(oracles: list[dict[int, Snapshot]], step: int, facets: bool = False) -> dict[str, list[int]]:
    """``{name: ranks that differ from the reference}`` at ``step``, from every rank's snapshot.

    A differing trainable flag counts under the parameter's name (``facets=True`` keeps the key apart)."""
    snaps = [o.get(step, {}) for o in oracles]
    names = sorted(set().union(*snaps))
    stages = [{k.split(".", 1)[0] for k in s if k.startswith("stage")} for s in snaps]
    out = {}
    for n in names:
        stage = n.split(".", 1)[0] if n.startswith("stage") else None
        if n == EXPERT_GROUP:
            continue
        if n.startswith("3.") and EXPERT_GROUP in snaps[0]:  # an expert: within each group, absent or not
            ranks = []
            for c in sorted({s[EXPERT_GROUP] for s in snaps}):
                group = [r for r, s in enumerate(snaps) if s[EXPERT_GROUP] == c]
                ranks += [group[i] for i in odd_ranks([snaps[r].get(n, b"<absent>") for r in group])]
        elif stage is not None:  # a pipeline stage's value: compared among that stage's ranks, absent or not
            group = [r for r in range(len(snaps)) if stage in stages[r]]
            ranks = [group[i] for i in odd_ranks([snaps[r].get(n, b"<absent>") for r in group])]
        elif _held_only(n, snaps):
            holders = [r for r, s in enumerate(snaps) if n in s]
            ranks = [holders[i] for i in odd_ranks([snaps[r][n] for r in holders])]
        else:
            ranks = odd_ranks([s.get(n, b"<absent>") for s in snaps])
        if ranks:
            out[n if facets else n.removesuffix(".requires_grad")] = ranks
    return out


def covers(reported: str, truth: str) -> bool:
    """A reported name localizes a true one: the same name, or a part of it (``0.weight.requires_grad``)."""
    return reported == truth or reported.startswith(truth + ".")


def localized(mismatches: list[dict[str, Any]], truth: dict[str, list[int]]) -> bool:
    """Every diverged value is named with the right ranks, and nothing else is named."""
    rep = [(m["name"], sorted(m["ranks"])) for m in mismatches]
    every_true = all(any(covers(n, t) and r == ranks for n, r in rep) for t, ranks in truth.items())
    no_extra = all(any(covers(n, t) for t in truth) for n, _ in rep)
    return every_true and no_extra


def false_alarm(mismatches: list[dict[str, Any]], truth: dict[str, list[int]]) -> bool:
    """A value reported as differing whose bytes are equal on every rank."""
    return any(not any(covers(m["name"], t) for t in truth) for m in mismatches)


def false_transient(transient: dict[str, Any] | None, truth_by_step: dict[int, dict[str, list[int]]]) -> bool:
    """A ``transient`` report whose names the oracle never saw differ within the steps it claims."""
    if not transient:
        return False
    lo, hi = transient.get("first_diverged_step"), transient.get("last_diverged_step")
    seen = {n for s, d in truth_by_step.items() if (lo is None or s >= lo) and (hi is None or s <= hi) for n in d}
    names = transient.get("names") or []
    return not seen or any(not any(covers(n, t) for t in seen) for n in names)


def score(spec: Any, result: dict[str, Any]) -> dict[str, Any]:
    """What the tool said beside the truth, for one run (``spec`` a RunSpec, ``result`` the gathered run)."""
    oracles, records = result["oracles"], result["records"]
    steps = sorted(oracles[0]) if oracles and oracles[0] else []
    truth_by_step = {s: diverged(oracles, s) for s in steps}
    first = next((s for s in steps if truth_by_step[s]), None)
    row: dict[str, Any] = {
        "run_id": spec.run_id,
        "kind": spec.kind,
        "world": spec.world,
        "fault_step": spec.fault_step,
        "fault_rank": spec.fault_rank,
        "target": spec.target,
        "bit": spec.bit,
        "true_first_step": first,
        "true_first_names": truth_by_step.get(first, {}) if first is not None else {},
        "true_first_facets": sorted(diverged(oracles, first, facets=True)) if first is not None else [],
        "true_last_facets": sorted(diverged(oracles, steps[-1], facets=True)) if steps else [],
        "reported": None,
        "audits": len(records),
        "false_alarm_audits": 0,
        "missed_audits": 0,
        "repeated_transients": 0,
        "detected": False,
        "detected_step": None,
        "localized": False,
        "exact": False,
        "latency": None,
        "persisted": False,
        "reported_first_step": None,
        "pinpoint": None,
        "error": next((e for e in result["errors"] if e), None),
        "hang": False,
        "early_divergence": first is not None and spec.fault_step is not None and first < spec.fault_step,
    }
    after = [rec["step"] for rec in records if first is not None and rec["step"] >= first]
    row["persisted"] = bool(after) and bool(truth_by_step.get(after[0]))
    prev = 0
    for rec in records:
        a = rec["step"]
        truth = truth_by_step.get(a, {})
        between = {n for s in steps if prev < s <= a for n in truth_by_step[s]}
        mism = rec.get("mismatches") or []
        transient = rec.get("transient")
        if (
            false_alarm(mism, truth)
            or false_transient(transient, truth_by_step)
            or (not rec["in_sync"] and not mism and not truth)
        ):
            row["false_alarm_audits"] += 1
        if transient and (transient.get("first_diverged_step") or 0) <= prev:
            row["repeated_transients"] += 1  # true, but it reaches back to a step an earlier audit covered
        if truth and rec["in_sync"]:
            row["missed_audits"] += 1
        if first is not None and a >= first and not row["detected"]:
            _first_detection(row, rec, truth, between, first)
        prev = a
    return row


def _first_detection(
    row: dict[str, Any], rec: dict[str, Any], truth: dict[str, list[int]], between: set[str], first: int
) -> None:
    transient = rec.get("transient")
    if not rec["in_sync"] and rec.get("mismatches") and not rec.get("within_tolerance"):
        row["reported"] = {m["name"]: sorted(m["ranks"]) for m in rec["mismatches"]}
        row.update(
            detected=True,
            detected_step=rec["step"],
            localized=localized(rec["mismatches"], truth),
            reported_first_step=rec.get("first_diverged_step"),
            pinpoint=rec.get("pinpoint"),
        )
        row["exact"] = rec.get("pinpoint") == "exact" and rec.get("first_diverged_step") == first
    elif transient:
        names = set(transient.get("names") or [])
        row["reported"] = {"transient": sorted(names)}
        row.update(
            detected=True,
            detected_step=rec["step"],
            pinpoint="transient",
            localized=all(any(covers(n, t) for n in names) for t in between),
            reported_first_step=transient.get("first_diverged_step"),
        )
        row["exact"] = transient.get("first_diverged_step") == first
    if row["detected"]:
        row["latency"] = row["detected_step"] - first


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
