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

``--persisting``: a divergence that persists, then a bit flip at rest on another rank, on 2, 3 and 4 ranks under
``warn``, ``resync``, ``raise`` + ``exit_code`` and ``overlap`` (:mod:`campaign_lifetime`, which also holds the
resume rows: ``python benchmarks/campaign_lifetime.py --resume``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs-per-kind", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--kinds", default=None, help="comma-separated kinds (default: every kind and healthy)")
    ap.add_argument("--persisting", action="store_true", help="a persisting divergence, then a flip on another rank")
    ap.add_argument("--variants", default="", help="--persisting: first divergences (drift,tie,raise,overlap)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    if a.persisting:  # benchmarks/campaign_lifetime.py
        from campaign_lifetime import persisting

        persisting(a.runs_per_kind, a.seed, a.variants)
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
