"""Fault-injection campaign: inject one real fault per run, compare what the audit said with byte-level truth.

    python benchmarks/campaign.py --runs-per-kind 6 --worlds 2,4 --seed 0 --json campaign.json

Each run is a seeded gloo DDP loop (:mod:`campaign_faults`) on 2 or 4 forked CPU ranks, auditing with
``Auditor(pinpoint=True)`` every 3-5 steps, with one fault from the catalogue injected on one rank at a
random step between audits (or none: healthy runs and not-a-fault controls). Every rank snapshots the
exact bytes of everything audited at every step; the parent compares them (:mod:`campaign_oracle`) and
scores each run: detected, localized (tensor names and ranks), exact first step, latency in steps, false
alarms, hangs. Prints one markdown table per fault kind with totals, and the command that made it.
``--runs-per-kind`` counts runs per kind *and* world size.

``--pairs`` runs the combination campaign instead (:mod:`campaign_pairs`: every pair of options, training
patterns, adapters and faults, scored against bytes gathered from every rank):

    python benchmarks/campaign.py --pairs --slice full --seed 0
"""

from __future__ import annotations

import argparse
import json
import pickle
import queue
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from campaign_faults import CONTROLS, FAULTS, HEALTHY, PARTIAL, RunSpec, make_spec, run_on_rank
from campaign_oracle import median, score
from harness import table
from ranks import join_group, leave  # after harness, which puts tests/ on the path

RUN_TIMEOUT_S = 120.0
"""A run that has not reported within this many seconds is a hang (its batch is killed, the rest go on)."""


def plan(worlds: list[int], runs_per_kind: int, seed: int, kinds: list[str] | None = None) -> list[RunSpec]:
    """Every run of the campaign, in a fixed order (the same seed gives the same runs)."""
    kinds = kinds or [*FAULTS, *HEALTHY, *CONTROLS]
    return [make_spec(w, k, n, seed) for w in worlds for k in kinds for n in range(runs_per_kind)]


def _rank_main(specs: list[RunSpec], rank: int, world: int, port: int, q: Any) -> None:
    try:
        join_group(rank, world, port, RUN_TIMEOUT_S)
        for spec in specs:
            out = run_on_rank(spec, rank, world)
            if rank == 0:
                q.put((spec.run_id, pickle.dumps(out)))
            if any(out["errors"]):
                break  # a failed run may leave the channel unusable: the parent starts a fresh batch
    finally:
        leave(q)


def _batch(specs: list[RunSpec], run_timeout_s: float, on_result: Any) -> dict[str, Any]:
    """Run ``specs`` (one world size) in one set of forked ranks; stop at the first run that hangs or dies.

    Returns ``{run_id: gathered result}`` for the runs that reported, and ``{run_id: "hang"}`` for the one
    that did not; runs after it are left for the next batch.
    """
    import torch._dynamo  # noqa: F401 - DDP imports it lazily; once here, every forked rank inherits it
    from campaign_exec import fork_ranks, reap

    procs, q = fork_ranks(_rank_main, specs, specs[0].world)
    got: dict[str, Any] = {}
    grace_s = 2.0  # for the ranks to leave by themselves; none after a hang: they are stuck, killed at once
    try:
        for spec in specs:
            try:
                run_id, payload = q.get(timeout=run_timeout_s)
            except queue.Empty:
                got[spec.run_id] = "hang"
                grace_s = 0.0
                break
            got[run_id] = pickle.loads(payload)
            on_result(run_id, got[run_id])
            if any(got[run_id]["errors"]):
                break
    finally:
        reap(procs, grace_s)
    return got


def execute(specs: list[RunSpec], run_timeout_s: float = RUN_TIMEOUT_S, log: Any = None) -> list[dict[str, Any]]:
    """Run every spec (batched by world size) and score each against the truth; one row per run."""
    rows: list[dict[str, Any]] = []
    pending = list(specs)
    by_id = {s.run_id: s for s in specs}

    def on_result(run_id: str, res: Any) -> None:
        spec = by_id[run_id]
        pending.remove(spec)
        rows.append(score(spec, res) if res != "hang" else _hang_row(spec))
        if log:
            log(rows[-1])

    while pending:
        world = pending[0].world
        batch = [s for s in pending if s.world == world]
        got = _batch(batch, run_timeout_s, on_result)
        hung = [run_id for run_id, res in got.items() if res == "hang"] or ([] if got else [batch[0].run_id])
        for run_id in hung:  # no report within the timeout, or the ranks died before the first one
            on_result(run_id, "hang")
    return rows


def _hang_row(spec: RunSpec) -> dict[str, Any]:
    return {
        "run_id": spec.run_id,
        "kind": spec.kind,
        "world": spec.world,
        "hang": True,
        "detected": False,
        "localized": False,
        "exact": False,
        "latency": None,
        "false_alarm_audits": 0,
        "missed_audits": 0,
        "repeated_transients": 0,
        "persisted": False,
        "true_first_step": None,
        "error": "hang",
        "audits": 0,
        "early_divergence": False,
    }


def _cell(n: int, of: int) -> str:
    return f"{n}/{of}" if of else "-"


def summarize(rows: list[dict[str, Any]]) -> str:
    """One markdown line per kind, then totals for faulty, healthy and control runs."""
    headers = [
        "kind",
        "runs",
        "still diverged at next audit",
        "detected",
        "localized tensor+rank",
        "exact first step",
        "median latency (steps)",
        "false alarms, runs (audits)",
        "in-sync verdicts while bytes differed",
        "hangs",
        "errors",
    ]
    kinds = [*FAULTS, *HEALTHY, *CONTROLS, *PARTIAL]
    groups = [(k, [r for r in rows if r["kind"] == k]) for k in kinds]
    groups = [(k, rs) for k, rs in groups if rs]
    totals = [
        ("**all faulty**", [r for r in rows if r["kind"] in FAULTS]),
        ("**all healthy**", [r for r in rows if r["kind"] in HEALTHY]),
        ("**all controls**", [r for r in rows if r["kind"] in CONTROLS]),
        ("**all partial-replica**", [r for r in rows if r["kind"] in PARTIAL]),
    ]
    return table(headers, [_line(k, rs) for k, rs in [*groups, *[t for t in totals if t[1]]]])


def _line(kind: str, rs: list[dict[str, Any]]) -> list[str]:
    faulty = [r for r in rs if (r["kind"] in FAULTS or r["kind"] in PARTIAL) and r["true_first_step"] is not None]
    lat = [r["latency"] for r in faulty if r["latency"] is not None]
    med = median(lat)
    audits = sum(r["audits"] for r in rs)
    return [
        kind,
        str(len(rs)),
        _cell(sum(r["persisted"] for r in faulty), len(faulty)),
        _cell(sum(r["detected"] for r in faulty), len(faulty)),
        _cell(sum(r["localized"] for r in faulty), len(faulty)),
        _cell(sum(r["exact"] for r in faulty), len(faulty)),
        "-" if med is None else f"{med:g}",
        f"{sum(r['false_alarm_audits'] > 0 for r in rs)} ({sum(r['false_alarm_audits'] for r in rs)}/{audits})",
        f"{sum(r['missed_audits'] for r in rs)}/{audits}",
        str(sum(r["hang"] for r in rs)),
        str(sum(bool(r["error"]) and not r["hang"] for r in rs)),
    ]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--pairs" in argv:  # the combination campaign (benchmarks/campaign_pairs.py)
        from campaign_pairs import main as pairs

        return pairs([a for a in argv if a != "--pairs"])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs-per-kind", type=int, default=6, help="runs of each kind on each world size")
    p.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default="", help="comma-separated kinds (default: all)")
    p.add_argument("--json", default="", help="write every run's row here")
    p.add_argument("--run-timeout", type=float, default=RUN_TIMEOUT_S)
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",") if w]
    specs = plan(worlds, args.runs_per_kind, args.seed, [k for k in args.kinds.split(",") if k] or None)
    t0 = time.monotonic()

    def log(row: dict[str, Any]) -> None:
        verdict = "hang" if row["hang"] else ("detected" if row["detected"] else "-")
        print(
            f"[{time.monotonic() - t0:7.1f}s] {row['run_id']}: {verdict}"
            f" exact={row['exact']} localized={row['localized']} fa={row['false_alarm_audits']}"
            f" err={row['error']}",
            file=sys.stderr,
            flush=True,
        )

    rows = execute(specs, args.run_timeout, log)
    cmd = "python benchmarks/campaign.py " + " ".join(argv)
    print(summarize(rows))
    repeated = sum(r["repeated_transients"] for r in rows)
    if repeated:
        print(f"\n{repeated} transient report(s) reached back to a step an earlier audit had already covered.")
    print(f"\n{len(rows)} runs in {time.monotonic() - t0:.0f} s. Command: `{cmd}`")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
