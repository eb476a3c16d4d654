"""The combination campaign (``python benchmarks/campaign.py --pairs``): every pair of (option, training pattern,
adapter, fault, world size), healthy and with a planted fault on rank 0 and on rank 1, scored against bytes.

    python benchmarks/campaign.py --pairs --slice ci      # every value of every factor once (~1-2 min)
    python benchmarks/campaign.py --pairs --slice full    # every pair, and the focus rows (docs/reliability.md)
    python benchmarks/campaign.py --pairs --row '{"overlap": true, "pattern": "clamp"}'   # one row: a reproduction

First the adapters are probed: each pair of option values (and, for ``LoopAudit``, which is given the
optimizer, each option value with each optimizer) is constructed alone; a pair the library refuses at
construction is listed with its error and left out of the design, so that the rows that run cover every other
pair. Then the seeded all-pairs design (:mod:`campaign_cover`) is run (:mod:`campaign_exec`) and each run is
scored against the bytes gathered from every rank (:mod:`campaign_truth`, :mod:`campaign_score`). A refusal at
run time (one the probe cannot see: a training pattern) is counted as ``refused``, not as a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import combinations
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: F401 - puts the repository and tests/ on the path
from campaign_case import Case, make_cases
from campaign_cover import (
    FACTORS,
    FOCUS,
    NOT_APPLICABLE,
    OPTIONS,
    Pair,
    all_pairs,
    each_value_once,
    focus_rows,
    row_pairs,
    uncovered,
)
from campaign_exec import RUN_TIMEOUT_S, Executor
from campaign_score import COLUMNS, FAILURES, failing, score, summarize


def _options(values: dict[str, Any]) -> dict[str, Any]:
    """The flat keywords of option values (as :meth:`Case.options` gives them)."""
    base = {f: FACTORS[f][0] for f in OPTIONS}
    base.update(values)
    kw = {k: base[k] for k in ("attribution", "overlap", "on_mismatch", "pinpoint", "coverage", "tolerance")}
    if base["grads"]:
        kw["include"] = ("params", "buffers", "optimizer", "grads")
    if base["check_batches"]:
        kw["check_batches"] = True
    return kw


def _construct(adapter: str, values: dict[str, Any], optimizer: str | None = None) -> str | None:
    """Build ``adapter`` with ``values`` (and, for the loop, ``optimizer``); the refusal's error, or ``None``."""
    try:
        if adapter == "loop":
            from campaign_case import Net, build_optimizer

            from weightsync_audit import LoopAudit

            model = Net(0)
            probe = Case("probe", 0, "healthy", "loop", optimizer or "adam_single", "plain", "flip", 2,
                         seed=0, fault_step=4, target="fc1.weight", element=0, bit=16, dup_step=4,
                         **{f: FACTORS[f][0] for f in OPTIONS})  # fmt: skip
            LoopAudit(model, build_optimizer(probe, model), verbose=False, **_options(values)).close()
        elif adapter == "lightning":
            from weightsync_audit import WeightSyncAudit

            WeightSyncAudit(verbose=False, **_options(values))
        else:
            from weightsync_audit.transformers import WeightSyncAuditCallback

            WeightSyncAuditCallback(verbose=False, **_options(values))
    except Exception as exc:  # noqa: BLE001 - a refusal: its words are the point
        return f"{type(exc).__name__}: {exc}"
    return None


def probe(adapters: tuple[str, ...] = FACTORS["adapter"]) -> dict[Pair, str]:
    """Pairs refused at construction, with the error: (adapter, option value) for a value refused alone, else
    (option value, option value) refused with each adapter (loop: also with each optimizer)."""
    refused: dict[Pair, str] = {}
    order = list(FACTORS)
    for adapter in adapters:
        for f in OPTIONS:
            for v in FACTORS[f][1:]:
                err = _construct(adapter, {f: v})
                if err:
                    refused[(("adapter", adapter), (f, v))] = err
        for f, g in combinations(OPTIONS, 2):
            for a in FACTORS[f]:
                for b in FACTORS[g]:
                    if (("adapter", adapter), (f, a)) in refused or (("adapter", adapter), (g, b)) in refused:
                        continue
                    err = _construct(adapter, {f: a, g: b})
                    if err and ((f, a), (g, b)) not in refused:
                        refused[((f, a), (g, b))] = f"{adapter}: {err}"
    for opt in FACTORS["optimizer"]:
        for f in OPTIONS:
            for v in FACTORS[f]:
                err = _construct("loop", {f: v}, opt)
                if err and (("adapter", "loop"), (f, v)) not in refused:
                    refused[(("optimizer", opt), (f, v))] = f"loop: {err}"
    return {(a, b) if order.index(a[0]) < order.index(b[0]) else (b, a): e for (a, b), e in refused.items()}


def plan(seed: int, slice_: str, refused: dict[Pair, str]) -> tuple[list[dict[str, Any]], list[int], int]:
    """The rows (refused and not-applicable pairs excluded), the indices the slice runs, and how many of the
    rows are the all-pairs design (the rest: :data:`campaign_cover.FOCUS`, in the full slice)."""
    rows = all_pairs(FACTORS, [*NOT_APPLICABLE, *refused], seed=seed)
    design = len(rows)
    if slice_ == "ci":
        return rows, each_value_once(FACTORS, rows), design
    rows += [r for r in focus_rows() if not (row_pairs(r, list(FACTORS)) & {*NOT_APPLICABLE, *refused})]
    return rows, list(range(len(rows))), design


def run(
    seed: int,
    slice_: str,
    *,
    timeout_s: float = RUN_TIMEOUT_S,
    log: Any = None,
    only: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Probe, plan, run and score; everything the table and the tests read. ``only``: run these rows instead
    (each completed with every other factor's first value; no probe): a reproduction."""
    if only is not None:
        refused: dict[Pair, str] = {}
        rows = [{f: {**{g: v[0] for g, v in FACTORS.items()}, **r}[f] for f in FACTORS} for r in only]
        picked, design = list(range(len(rows))), len(rows)
    else:
        refused = probe()
        rows, picked, design = plan(seed, slice_, refused)
    cases = [c for c in make_cases(rows, seed) if c.row in picked]
    results: list[dict[str, Any]] = []

    def on(case: Case, res: Any) -> None:
        results.append(score(case, res))
        if log is not None:
            log(results[-1])

    Executor(timeout_s, on).run(cases)
    ran = [rows[i] for i in sorted({r["case"]["row"] for r in results if not r["refused"]})]
    lost = uncovered(FACTORS, ran, [*NOT_APPLICABLE, *refused]) if slice_ == "full" else set()
    return {"rows": rows, "design": design, "picked": picked, "refused": refused, "results": results,
            "lost_pairs": sorted(lost, key=repr)}  # fmt: skip


def report(out: dict[str, Any], command: str, seconds: float) -> str:
    """The markdown the docs take: the table, the refused pairs, the failing runs, the command."""
    results = out["results"]
    parts = [summarize(results), ""]
    parts.append(f"{len(results)} runs ({len(out['picked'])} rows x healthy, fault on rank 0, on rank 1, on rank 0 "
                 f"then rank 1) in {seconds:.0f} s. Command: `{command}`")  # fmt: skip
    if len(out["rows"]) > out["design"]:
        parts.append(f"Rows {out['design']}-{len(out['rows']) - 1} are the focus rows: " + "; ".join(FOCUS))
    total = {c: sum(bool(r[c]) for r in results) for c in COLUMNS}
    parts.append("Failure columns (runs): " + ", ".join(f"{c} {total[c]}" for c in FAILURES))
    parts += ["", "Pairs not applicable (no such training run):"]
    parts += [f"- {a[0]}={a[1]} with {b[0]}={b[1]}: {why}" for (a, b), why in NOT_APPLICABLE.items()]
    parts += ["", "Pairs refused at construction (probe):"]
    parts += [f"- {a[0]}={a[1]} with {b[0]}={b[1]}: {why}" for (a, b), why in out["refused"].items()] or ["- none"]
    at_run = [r for r in results if r["refused"]]
    if at_run:
        parts += ["", "Refused at run time:"] + [f"- `{r['run_id']}` {r['describe']}: {r['detail'][0]}" for r in at_run]
    if out["lost_pairs"]:
        parts += ["", f"{len(out['lost_pairs'])} pair(s) not exercised (their rows were refused at run time)"]
    parts += ["", "Failing runs:"] + (failing(results) or ["- none"])
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="campaign.py --pairs", description=__doc__.split("\n\n")[0])
    p.add_argument("--slice", choices=("ci", "full"), default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write every run's row here")
    p.add_argument("--run-timeout", type=float, default=RUN_TIMEOUT_S)
    p.add_argument(
        "--row",
        action="append",
        default=None,
        metavar="JSON",
        help="run only this row (factors not named take their first value), e.g. '{\"overlap\": true}'",
    )
    args = p.parse_args(argv)
    t0 = time.monotonic()

    def log(row: dict[str, Any]) -> None:
        bad = [c for c in (*COLUMNS, "refused", "tie repair") if row[c]]
        print(f"[{time.monotonic() - t0:6.0f}s] {row['run_id']} {row['describe']}: {', '.join(bad) or 'ok'}",
              file=sys.stderr, flush=True)  # fmt: skip

    only = [json.loads(r) for r in args.row] if args.row else None
    out = run(args.seed, args.slice, timeout_s=args.run_timeout, log=log, only=only)
    command = "python benchmarks/campaign.py --pairs " + " ".join(argv)
    print(report(out, command, time.monotonic() - t0))
    if args.json:
        rows = {"command": command, "results": out["results"],
                "refused": [[list(a), list(b), e] for (a, b), e in out["refused"].items()]}  # fmt: skip
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


__all__ = ["main", "plan", "probe", "report", "row_pairs", "run"]
