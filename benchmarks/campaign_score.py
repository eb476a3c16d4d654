"""Scoring one run of the combination campaign against the bytes (:mod:`campaign_truth`), and the table.

A record covering step ``s`` is judged on its *window*: the points ``E(s)``, ``X(s)``, ``Q(s+1)``,
``P(s+1)`` (an overlapped audit covers ``s`` while step ``s+1`` runs; a record taken just before the update
covers ``Q``/``P``). The true value of a tensor is the one a rank without a planted fault holds (with 3 ranks,
rank 2; with 2, the rank not faulted), known from the plan, not from a vote. Columns, each a count of runs:

- ``false alarm``: a record names a tensor whose bytes were equal on every rank at every point of its window
  (or says diverged with nothing differing; or a ``transient`` naming what never differed; or a
  hyper-parameter said to have "differed as optimizer step s read it" where no lr fault was planted at ``s``
  on a rank it names);
- ``false all-clear``: an in-sync record while an audited tensor differed at every point of its window (a
  sampled record is not held to tensors over 64 KiB, which it reads a slice of);
- ``false blame``: a ``blame`` names a rank whose bytes equal the reference value throughout the window;
- ``repair from corrupted``: between two points with no training between them (``E``->``X``, ``Q``->``P``)
  the replicas went from differing to equal, equal to the corrupted rank's bytes and not the reference;
  after a tie vote (2 ranks, or 3 that all differ) and no blame naming a rank (no evidence at all: attribution
  off, or undecided) it goes to ``tie repair`` instead (information: nothing could know better; the undecided
  blame is its own column);
- ``crash``, ``hang``; ``fault not named``: the bytes diverged where an audit had to see it (a difference
  lasting a record's whole window, in what it reads whole; with ``pinpoint``, any step's difference, which
  its ``transient`` report covers) and no record named a diverged tensor (with the ranks that deviate, when
  3 ranks make them knowable);
- with ``attribution``: ``blame undecided`` (the first divergent record names no rank) and ``wrong cause``
  (it names the faulted rank with evidence or ``hardware_suspect`` the planted fault does not give);
- with ``pinpoint``: ``wrong date`` (``pinpoint: exact`` with a ``first_diverged_step`` the bytes deny);
- with ``check_batches``: ``duplicate batch not noted`` (ranks 0 and 1 trained on one batch at an audited step).
"""

from __future__ import annotations

from typing import Any

from campaign_case import Case
from campaign_cover import FACTORS, FOCUS_ONLY
from harness import table

from weightsync_audit.text import BEFORE_STEP

SAMPLED_FROM = 65536
"""Bytes over which ``coverage="1/4"`` reads a slice of a tensor per audit."""
EXPECTED: dict[str, tuple[str, bool]] = {
    "flip": ("at_rest_change", True),
    "write": ("at_rest_write", False),
    "compute": ("update_not_reproducible", True),
    "lr": ("deterministic_difference", False),
    "grad": ("deterministic_difference", False),
}
"""Per fault: the evidence a blame should give and whether the machine is suspect."""
FAILURES = ("false alarm", "false all-clear", "false blame", "repair from corrupted", "crash", "hang",
            "fault not named")  # fmt: skip
EXTRAS = ("blame undecided", "wrong cause", "wrong date", "duplicate batch not noted")
INFO = ("refused", "tie repair", "raised")
PRE_STEP_HOOKS = ("before_optimizer_step", "on_before_optimizer_step", "on_pre_optimizer_step")
"""The hooks of an audit taken right before the optimizer step its record's ``step`` numbers (the gradients)."""
COLUMNS = FAILURES + EXTRAS


class Truth:
    """The gathered classes of one run, read per tensor and point."""

    def __init__(self, truth: dict[str, Any], case: Case) -> None:
        self.classes, self.points, self.nbytes = truth["classes"], truth["points"], truth["nbytes"]
        self.case, self.world = case, case.world
        kinds = {"param", "buffer", "optimizer"} | ({"grad"} if case.grads else set())
        self.keys = [k for k in self.classes if k[0] in kinds]

    def values(self, key: Any, pt: tuple[str, int]) -> list[int | None]:
        ids = self.classes.get(key, {})
        return [ids.get((pt[0], pt[1], r)) for r in range(self.world)]

    def reference(self, key: Any, pt: tuple[str, int]) -> int | None:
        """The true value: a rank no fault was planted on yet holds it (with 3 ranks, rank 2 always); after a
        fault on every rank (``fault01`` on 2 ranks), rank 0 again when the ranks agreed at the last point
        before the second fault (its first one repaired or healed); else unknown (``None``)."""
        vals = self.values(key, pt)
        plants = self.case.plants()
        clean = [r for r in range(self.world) if not any(pr == r and ps <= pt[1] for pr, ps in plants)]
        if clean:
            return vals[clean[0]]
        before = [p for p in self.points if p[0] in "QPEX" and p[1] < plants[-1][1]]
        if before and len(set(self.values(key, before[-1]))) == 1:
            return vals[0]
        return None

    def deviating(self, key: Any, pt: tuple[str, int]) -> list[int]:
        """The ranks whose bytes differ from the true value at ``pt`` (none when the ranks agree, or the
        true value is unknown)."""
        vals = self.values(key, pt)
        if all(v is None for v in vals) or len(set(vals)) == 1:
            return []
        ref = self.reference(key, pt)
        return [] if ref is None else [r for r, v in enumerate(vals) if v != ref]

    def differs(self, key: Any, pt: tuple[str, int]) -> bool:
        """The ranks hold different bytes of ``key`` at ``pt`` (whoever is right)."""
        vals = self.values(key, pt)
        return not all(v is None for v in vals) and len(set(vals)) > 1

    def window(self, step: int, hook: str | None = None) -> list[tuple[str, int]]:
        """The points a record at ``step`` reads: ``E``, ``X`` of its step and ``Q``, ``P`` of the next; a record
        taken right before the optimizer step ``step`` (a gradient audit) reads ``Q``, ``P`` of that step."""
        pre = hook in PRE_STEP_HOOKS
        want = [("Q", step), ("P", step)] if pre else [("E", step), ("X", step), ("Q", step + 1), ("P", step + 1)]
        return [p for p in want if p in self.points]

    def diffs(self, pts: list[tuple[str, int]]) -> dict[Any, set[int]]:
        """The keys whose bytes differ across ranks at some of ``pts``, each with the ranks that deviate from
        the true value there (empty when the true value is unknown)."""
        out: dict[Any, set[int]] = {}
        for k in self.keys:
            for pt in pts:
                if self.differs(k, pt):
                    out.setdefault(k, set()).update(self.deviating(k, pt))
        return out


def _matches(name: str, kind: str, truth: Truth) -> list[Any]:
    kind = "param" if kind == "structure" else kind
    return [
        k for k in truth.classes
        if k[0] == kind and (k[1] == name or k[1].startswith(name + ".") or name.startswith(k[1] + "."))
    ]  # fmt: skip


def covers_step(rec: dict[str, Any]) -> int:
    return int((rec.get("overlap") or {}).get("covers_step", rec["step"]))


def _between(truth: Truth, lo: int, hi: int) -> dict[Any, set[int]]:
    return truth.diffs([p for p in truth.points if p[0] in "QPEX" and lo < p[1] <= hi])


def _record(truth: Truth, rec: dict[str, Any], prev: int, row: dict[str, Any]) -> None:
    s = covers_step(rec)
    pts = truth.window(s, rec.get("hook"))
    diff = truth.diffs(pts)
    case = truth.case
    mism = rec.get("mismatches") or []
    wrong = []
    planted_lr: set[int] = set()  # the ranks of a hyper-parameter mismatch that names the planted lr
    for m in mism:
        said = str(m.get("detail") or "")
        read_at = None
        if said.startswith(BEFORE_STEP):  # a hyper-parameter that differed as a step read it, equal since
            read_at = int(said[len(BEFORE_STEP) :].split()[0])
        elif rec.get("hook") in PRE_STEP_HOOKS and m["name"].startswith("param_groups."):
            read_at = s  # right before the update: as the step reads it (the oracle keeps no hyper-parameter at Q, P)
        if read_at is not None:
            sides = m["ranks"] + (m.get("reference_ranks") or []) if case.world == 2 else m["ranks"]  # a tie: either
            lr_planted = case.fault == "lr" and any(st == read_at and r in sides for r, st in case.plants())
            if lr_planted:
                row["_named"] = True
                planted_lr.update(m["ranks"])
            else:
                wrong.append(m["name"])
            continue
        keys = _matches(m["name"], m["kind"], truth)
        if not keys:
            row["unknown names"].append(m["name"])
        elif not any(k in diff for k in keys):
            wrong.append(m["name"])
        elif case.world == 2 or any(not diff[k] or sorted(diff[k]) == sorted(m["ranks"]) for k in keys if k in diff):
            row["_named"] = True  # with 3 ranks, named with the ranks that deviate (when the truth knows them)
    transient = rec.get("transient") or {}
    if transient:
        lo, hi = transient.get("first_diverged_step") or prev, transient.get("last_diverged_step") or s
        seen = _between(truth, lo - 1, hi + 1)
        for n in transient.get("names") or []:
            keys = [
                k for k in _matches(n, "param", truth) + _matches(n, "optimizer", truth) + _matches(n, "buffer", truth)
            ]
            if keys and not any(k in seen for k in keys):
                wrong.append(f"transient {n}")
            elif any(k in seen for k in keys):
                row["_named"] = True
    if wrong or (not rec["in_sync"] and not mism and not diff):
        row["false alarm"] += 1
        row["detail"].append(f"false alarm at {s}: {wrong or 'diverged, nothing named'}")
    sampled, checked = bool(rec.get("coverage")), rec.get("checked") or {}
    visible = [k for k in diff if checked.get(k[0], 1) and all(truth.differs(k, p) for p in pts)]
    if [k for k in visible if not (sampled and truth.nbytes.get(k, 0) > SAMPLED_FROM)]:
        row["_visible"] = True  # a difference this record had to see: it lasted its whole window
    if rec["in_sync"] and not transient:
        missed = [k for k in diff if checked.get(k[0], 1) and all(truth.differs(k, p) for p in pts)]
        missed = [k for k in missed if not (sampled and truth.nbytes.get(k, 0) > SAMPLED_FROM)]
        if missed:
            row["false all-clear"] += 1
            row["detail"].append(f"in sync at {s} while {[k[1] for k in missed][:3]} differed")
    blame = rec.get("blame") or {}
    if blame.get("ranks") and all(diff.values()):  # judged where the truth knows who deviates
        dev = (set().union(*diff.values()) if diff else set()) | planted_lr
        if set(blame["ranks"]) - dev:
            row["false blame"] += 1
            row["detail"].append(f"blame {blame['ranks']} ({blame.get('evidence')}) at {s}, bytes say {sorted(dev)}")
    if case.pinpoint and rec.get("pinpoint") == "exact" and not rec["in_sync"]:
        date = _first_of_current(truth, s)
        if date is not None and rec.get("first_diverged_step") != date:
            row["wrong date"] += 1
            row["detail"].append(f"dated {rec.get('first_diverged_step')}, bytes first differed at {date}")


def _first_of_current(truth: Truth, s: int) -> int | None:
    """The first step of the divergence in front of the record at ``s``: the first ``E`` point that differs
    after the last point (any label) at which the ranks agreed on every tensor but gradients."""
    keys = [k for k in truth.keys if k[0] != "grad"]
    pts = [p for p in truth.points if p[0] in "QPEX"]
    if ("E", s) not in pts:
        return None
    upto = pts[: pts.index(("E", s)) + 1]
    agreed = [i for i, p in enumerate(upto) if not any(truth.differs(k, p) for k in keys)]
    after = upto[agreed[-1] + 1 :] if agreed else upto
    return next((p[1] for p in after if p[0] == "E" and any(truth.differs(k, p) for k in keys)), None)


def _repairs(truth: Truth, records: list[dict[str, Any]], row: dict[str, Any]) -> None:
    keys = [k for k in truth.keys if k[0] != "grad"]
    for a_label, b_label in (("E", "X"), ("Q", "P")):
        for a in [p for p in truth.points if p[0] == a_label]:
            b = (b_label, a[1])
            if b not in truth.points:
                continue
            for k in keys:
                dev = truth.deviating(k, a)
                after = truth.values(k, b)
                if not dev or len(set(after)) != 1 or after[0] is None:
                    continue
                bad = truth.values(k, a)[dev[0]]
                if after[0] == bad and after[0] != truth.reference(k, a):
                    near = [r for r in records if r.get("action") == "resynced" and covers_step(r) in (a[1], a[1] - 1)]
                    # A tie that nothing decided (no majority: 2 ranks, or 3 that all differ; no blame naming a
                    # rank: attribution off, or undecided) keeps resync_src, as documented: nothing could know better.
                    tie = any("tie vote" in str(m.get("detail") or "") for r in near for m in r.get("mismatches") or [])
                    evidence = not tie or any((r.get("blame") or {}).get("ranks") for r in near)
                    col = "repair from corrupted" if evidence else "tie repair"
                    row[col] += 1
                    row["detail"].append(f"{col}: {k[1]} at {a_label}{a[1]}->{b_label}{a[1]} took rank {dev}'s bytes")
                    return


def score(case: Case, res: Any) -> dict[str, Any]:
    """One run's row: the case, the counts of each column, and what failed in words."""
    row: dict[str, Any] = {"run_id": case.run_id, "case": case.as_dict(), "describe": case.describe(),
                           "detail": [], "unknown names": [], "records": 0}  # fmt: skip
    row.update({c: 0 for c in COLUMNS + INFO})
    if res == "hang":
        row["hang"] = 1
        return row
    if "fatal" in res:
        row["crash"] = 1
        row["detail"].append(res["fatal"])
        return row
    statuses = res["statuses"]
    refused = [s["refused"] for s in statuses if s.get("refused")]
    if refused:
        row["refused"] = 1
        row["detail"].append(refused[0])
        return row
    errors = [s["error"] for s in statuses if s.get("error")]
    if any(s.get("raised") for s in statuses) and case.on_mismatch != "raise":
        errors.append("WeightDivergenceError raised under on_mismatch=" + case.on_mismatch)
    row["raised"] = int(any(s.get("raised") for s in statuses))
    if errors:
        row["crash"] = 1
        row["detail"].append(errors[0])
        row["trace"] = next((s.get("trace") for s in statuses if s.get("trace")), None)
    if res["truth"] is None:
        return row
    truth = Truth(res["truth"], case)
    records = res["records"]
    row["records"] = len(records)
    row["timeline"] = [
        f"{r['step']}{'/' + str(covers_step(r)) if r.get('overlap') else ''}:{r.get('hook')}:"
        f"{'ok' if r['in_sync'] else 'DIVERGED'}:{r['action']}:{[m['name'] for m in r.get('mismatches') or []][:3]}"
        for r in records
    ]
    prev = 0
    for rec in records:
        _record(truth, rec, prev, row)
        prev = covers_step(rec)
    _repairs(truth, records, row)
    row["truth_first"] = next((t for lbl, t in truth.points if lbl in "QPEX" and truth.diffs([(lbl, t)])), None)
    diverged = truth.diffs([p for p in truth.points if p[0] in "QPEX"])
    visible = row.pop("_visible", False) or (case.pinpoint and truth.diffs([p for p in truth.points if p[0] == "E"]))
    if case.faulty_rank is not None and visible and not row.pop("_named", False):
        row["fault not named"] = 1
        row["detail"].append(f"not named: {sorted(k[1] for k in diverged)[:4]}")
    row.pop("_named", None)
    first_bad = next((r for r in records if not r["in_sync"] and r.get("mismatches")), None)
    if case.attribution and case.faulty_rank is not None and first_bad is not None:
        blame = first_bad.get("blame") or {}
        if not blame.get("ranks"):
            row["blame undecided"] = 1
            row["detail"].append(f"undecided at {covers_step(first_bad)}: {blame.get('detail', 'no blame')}"[:300])
        elif blame["ranks"] == [case.corrupted_at(covers_step(first_bad))]:
            got = (blame.get("evidence"), bool(blame.get("hardware_suspect")))
            if got != EXPECTED[case.fault]:
                row["wrong cause"] = 1
                row["detail"].append(f"{case.fault} blamed as {got}, expected {EXPECTED[case.fault]}")
    _batches(truth, records, row)
    return row


def _batches(truth: Truth, records: list[dict[str, Any]], row: dict[str, Any]) -> None:
    case = truth.case
    key = ("batch", "batch")
    d = case.dup_step
    if not case.check_batches or ("B", d) not in truth.points or key not in truth.classes:
        return
    vals = truth.values(key, ("B", d))
    if vals[0] != vals[1] or not any(covers_step(r) >= d and r.get("hook") not in PRE_STEP_HOOKS for r in records):
        return  # the oracle does not see the planted duplicate, or the run ended before it was audited (a raise
        # at the gradient audit before step d's update: its batch is handed over after the step)
    said = f"identical batches at step {d}"
    if not any(said in n for r in records for n in r.get("notes") or []):
        row["duplicate batch not noted"] = 1
        row["detail"].append(f"ranks 0, 1 trained on one batch at step {d}: no note")


def summarize(rows: list[dict[str, Any]]) -> str:
    """One line per value of every factor (runs with it), then the total."""
    headers = ["factor = value", "runs", "refused", *COLUMNS, "tie repair"]
    lines = []
    for f, values in FACTORS.items():
        for v in (*values, *FOCUS_ONLY.get(f, ())):
            rs = [r for r in rows if r["case"][f] == v]
            if rs or v in values:
                lines.append(_line(f"{f}={v}", rs))
    lines.append(_line("**all runs**", rows))
    return table(headers, lines)


def _line(label: str, rs: list[dict[str, Any]]) -> list[str]:
    return [label, str(len(rs)), str(sum(r["refused"] for r in rs))] + [
        str(sum(bool(r[c]) for r in rs)) for c in (*COLUMNS, "tie repair")
    ]


def failing(rows: list[dict[str, Any]]) -> list[str]:
    """One line per run with a failure: which columns, the case, and the first details."""
    out = []
    for r in rows:
        cols = [c for c in COLUMNS if r[c]]
        if cols:
            out.append(f"- `{r['run_id']}` {r['describe']}: {', '.join(cols)} — {'; '.join(r['detail'][:3])}")
    return out
