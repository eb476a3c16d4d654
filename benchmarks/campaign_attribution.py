"""The attribution campaign: each fault on one of 2 ranks, and whether the record's ``blame`` names it.

    python benchmarks/campaign_attribution.py --runs-per-kind 8 --seed 0 --json attribution.json

Each run is a plain gloo DDP + Adam loop on 2 forked CPU ranks (``tests/attribution_faults.py``), 10
steps on per-rank batches, audited by ``LoopAudit(attribution=True)`` every 1 to 3 steps (the collective
kind: an ``Auditor`` with ``attach_watch(hook=...)``, the all-reduce it wraps being the faulty one). One
fault is injected on a drawn rank (0 or 1, alternating) at a drawn step, tensor, element and bit
(seeded by ``--seed``, the kind and the run number). The truth is what was injected: the rank, and the
evidence the kind must give. Scored on the first divergent record: *correct* (``blame.ranks`` is exactly
the faulty rank and ``evidence`` the kind's), *wrong* (a rank named, or the evidence, is not), *undecided*
(no rank named; *class right* when its evidence is still the kind's), and *hardware_suspect right*.
Healthy runs count any divergent record as a false alarm. Two ranks always vote a tie: no run here can
be right by the tie rule.

    python benchmarks/campaign_attribution.py --persisting --runs-per-kind 2 --seed 0

``--persisting``: a divergence that persists (a drift within ``tolerance=1e-4`` written on one drawn rank),
then a bit flip at rest on another drawn rank, on 2, 3 and 4 ranks under ``warn`` and ``resync``, audited
every step. Scored at the flip's audit: *false blame* (``blame.ranks`` is not exactly the flipped rank),
*repair from a corrupted source* (after the resync a rank holds the flipped rank's corrupted tensor), and
*healthy machine named* (the ranks an ``exit_code`` evict file would name, ``evict_targets``, include another).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # the faults live with the tests

from attribution_faults import ATTRIBUTION_FAULTS, Fault, after_step, build, corrupting_hook, train_step
from harness import launch, table  # puts tests/ on the path

STEPS = 10


def draw(kind: str | None, n: int, seed: int) -> tuple[Fault, int]:
    """The fault of run ``n`` of ``kind`` and the audit cadence (steps)."""
    rng = random.Random(f"{seed}-{kind}-{n}")
    fault = Fault(kind, rank=n % 2, step=rng.randint(3, 7), param=rng.randrange(4), element=rng.randrange(64),
                  bit=rng.randrange(31))  # fmt: skip
    return fault, rng.randint(1, 3)


def run_fault(rank: int, world: int, fault: Fault, every: int, device: str = "cpu") -> list[dict[str, Any]]:
    """One run on this rank (model on ``device``): the records of its audits, every ``every`` steps."""
    from weightsync_audit import AttributionConfig, Auditor, LoopAudit, attach_watch
    from weightsync_audit.engine.config import AuditConfig

    _, ddp, opt = build(rank, device)
    records = []
    if fault.kind == "collective_bytes":
        auditor = Auditor(ddp, opt, config=AuditConfig(attribution=AttributionConfig(collective=True, recheck=1)))
        watch = auditor.attribution = attach_watch(
            auditor, ddp, [opt], hook=corrupting_hook(fault.rank, rank, fault.step)
        )
        for step in range(1, STEPS + 1):
            train_step(ddp, opt, rank, step, fault)
            watch.mark(step)
            if step % every == 0:
                records.append(auditor.audit(step=step).to_dict())
        return records
    audit = LoopAudit(ddp, opt, every_n_steps=every, verbose=False, attribution=True)
    for step in range(1, STEPS + 1):
        train_step(ddp, opt, rank, step, fault)
        r = audit.step(step)
        if r is not None:
            records.append(r.to_dict())
        after_step(ddp, rank, step, fault, opt=opt)
    audit.close()
    return records


def score(fault: Fault, records: list[dict[str, Any]]) -> dict[str, Any]:
    bad = [r for r in records if not r["in_sync"]]
    out: dict[str, Any] = {
        "kind": fault.kind or "healthy",
        "rank": fault.rank,
        "step": fault.step,
        "detected": bool(bad),
    }
    if fault.kind is None:
        out["false_alarm"] = bool(bad)
        return out
    evidence, hardware = ATTRIBUTION_FAULTS[fault.kind]
    blame = bad[0].get("blame") if bad else None
    out["blame"] = blame
    if blame is None:
        out["verdict"] = "missed"
    elif not blame["ranks"]:
        out["verdict"] = "undecided"
    elif blame["ranks"] == [fault.rank] and blame["evidence"] == evidence:
        out["verdict"] = "correct"
    else:
        out["verdict"] = "wrong"
    out["class_right"] = blame is not None and blame["evidence"] == evidence
    out["hardware_right"] = blame is not None and blame["hardware_suspect"] is (hardware and bool(blame["ranks"]))
    return out


def draw_persisting(world: int, n: int, seed: int) -> dict[str, int]:
    """Run ``n`` of the persisting pattern on ``world`` ranks: who drifts, who flips, when and where."""
    rng = random.Random(f"{seed}-persisting-{world}-{n}")
    drifting, flipped = rng.sample(range(world), 2)
    drift_after = rng.randint(2, 4)
    return {"drifting": drifting, "flipped": flipped, "drift_after": drift_after,
            "flip_after": drift_after + rng.randint(1, 3), "param": rng.randrange(4), "element": rng.randrange(64),
            "bit": rng.randrange(20, 31)}  # fmt: skip


def run_persisting(rank: int, world: int, plan: dict[str, int], on_mismatch: str) -> dict[str, Any]:
    """One run of the persisting pattern on this rank: the flip audit's record, the ranks an evict file would
    name, and the flipped tensor before and after that audit."""
    from attribution_faults import flip_bit

    from weightsync_audit import LoopAudit
    from weightsync_audit.integrations.evict import evict_targets

    _, ddp, opt = build(rank)
    audit = LoopAudit(ddp, opt, every_n_steps=1, on_mismatch=on_mismatch, verbose=False, attribution=True,
                      tolerance=1e-4)  # fmt: skip
    params = list(ddp.parameters())
    out: dict[str, Any] = {}
    for step in range(1, STEPS + 1):
        train_step(ddp, opt, rank, step, None)
        before = params[plan["param"]].detach().clone()
        r = audit.step(step)
        if step == plan["flip_after"] + 1 and r is not None:
            out = {"record": r.to_dict(), "named": sorted(evict_targets(r, exiting=True)), "before": before,
                   "after": params[plan["param"]].detach().clone()}  # fmt: skip
        if step == plan["drift_after"] and rank == plan["drifting"]:
            with torch.no_grad():
                params[2].mul_(1 + 1e-6)  # within the tolerance, spread over every element
        if step == plan["flip_after"] and rank == plan["flipped"]:
            flip_bit(params[plan["param"]], plan["element"], plan["bit"])
    audit.close()
    return out


def persisting(runs: int, seed: int) -> None:
    """The persisting pattern's table (see the module's docstring)."""
    rows = []
    for world in (2, 3, 4):
        for mode in ("warn", "resync"):
            counts = {"false": 0, "corrupted": 0, "healthy": 0, "right": 0}
            for n in range(runs):
                plan = draw_persisting(world, n, seed)
                per_rank = launch(run_persisting, world, plan, mode, timeout=300)
                rec, f = per_rank[0]["record"], plan["flipped"]
                counts["false"] += rec["blame"]["ranks"] != [f]
                counts["right"] += rec["blame"]["ranks"] == [f] and rec["blame"]["evidence"] == "at_rest_change"
                bad = per_rank[f]["before"]
                counts["corrupted"] += mode == "resync" and any(
                    q != f and torch.equal(o["after"], bad) for q, o in enumerate(per_rank)
                )
                counts["healthy"] += any(r != f for r in per_rank[0]["named"])
            rows.append([str(world), mode, str(runs), f"{counts['right']}/{runs}", str(counts["false"]),
                         str(counts["corrupted"]) if mode == "resync" else "-", str(counts["healthy"])])  # fmt: skip
    print(table(["ranks", "on_mismatch", "runs", "flip blamed (at_rest_change)", "false blame",
                 "repair from a corrupted source", "healthy machine named"], rows))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs-per-kind", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--kinds", default=None, help="comma-separated kinds (default: every kind and healthy)")
    ap.add_argument("--persisting", action="store_true", help="a persisting divergence, then a flip on another rank")
    a = ap.parse_args()
    t0 = time.perf_counter()
    if a.persisting:
        persisting(a.runs_per_kind, a.seed)
        print(f"persisting pattern: {time.perf_counter() - t0:.0f} s")
        return
    results = []
    kinds = [*ATTRIBUTION_FAULTS, None] if a.kinds is None else [k or None for k in a.kinds.split(",")]
    for kind in kinds:
        for n in range(a.runs_per_kind):
            fault, every = draw(kind, n, a.seed)
            per_rank = launch(run_fault, 2, fault, every, timeout=120)
            s = score(fault, per_rank[0])
            s["same_on_every_rank"] = [r.get("blame") for r in per_rank[0]] == [r.get("blame") for r in per_rank[1]]
            results.append(s)
    rows = []
    for kind in [*ATTRIBUTION_FAULTS, "healthy"]:
        rs = [r for r in results if r["kind"] == kind]
        n = len(rs)
        if not n:
            continue
        if kind == "healthy":
            rows.append([kind, str(n), "-", "-", "-", "-", "-", "-", f"{sum(r['false_alarm'] for r in rs)}"])
            continue
        count = {v: sum(r["verdict"] == v for r in rs) for v in ("correct", "wrong", "undecided", "missed")}
        rows.append([kind, str(n), f"{sum(r['detected'] for r in rs)}/{n}", f"{count['correct']}/{n}",
                     f"{count['wrong']}/{n}", f"{count['undecided']}/{n}",
                     f"{sum(r['class_right'] for r in rs)}/{n}", f"{sum(r['hardware_right'] for r in rs)}/{n}",
                     f"{sum(not r['same_on_every_rank'] for r in rs)}"])  # fmt: skip
    print(f"attribution campaign: {len(results)} runs on 2 ranks, seed {a.seed}, {time.perf_counter() - t0:.0f} s")
    print(table(["kind", "runs", "detected", "correct", "wrong", "undecided", "class right", "hardware_suspect right",
                 "false alarms / records differing across ranks"], rows))  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
