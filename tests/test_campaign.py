"""Seeded slices of the fault-injection campaign (benchmarks/campaign.py) on real gloo DDP ranks.

One run of every fault kind, every healthy variant and every not-a-fault control; each run's audit
records are scored against byte-level ground truth gathered from every rank. Kinds that the engine
cannot see yet are marked xfail (not strict) naming the item of issue 21 that fixes them.

And the combination campaign's CI slice (``campaign.py --pairs --slice ci``): every value of every factor
(options, training patterns, adapters, faults, 2 and 3 ranks) at least once, healthy and with the fault on
rank 0 and on rank 1, each failure column of its table one test.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
from campaign import execute, plan, summarize
from campaign_case import STEPS, Case, make_cases
from campaign_cover import FACTORS, NOT_APPLICABLE, all_pairs, each_value_once, row_pairs, uncovered
from campaign_faults import CONTROLS, FAULTS, HEALTHY, PARTIAL, make_spec
from campaign_oracle import covers, false_transient, localized, odd_ranks
from campaign_score import COLUMNS, FAILURES, score

SEED = 0

NOT_YET: dict[str, str] = {}
"""Kinds the engine misses, with the issue item that would fix them (none since issue 21's fixes)."""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    specs = plan([2], 1, SEED)
    out = execute(specs, run_timeout_s=90)
    print(summarize(out))
    return {r["kind"]: r for r in out}


def test_the_slice_covers_every_kind_once_and_no_run_hangs_or_errors(rows: dict[str, dict[str, Any]]) -> None:
    assert set(rows) == {*FAULTS, *HEALTHY, *CONTROLS}
    assert len(FAULTS) >= 10
    assert [k for k, r in rows.items() if r["hang"] or r["error"]] == []


@pytest.mark.parametrize("kind", list(FAULTS))
def test_the_oracle_sees_each_injected_fault_at_its_step_and_nothing_before(
    rows: dict[str, dict[str, Any]], kind: str
) -> None:
    r = rows[kind]
    assert r["true_first_step"] == r["fault_step"], r
    assert not r["early_divergence"]


@pytest.mark.parametrize(
    "kind",
    [pytest.param(k, marks=pytest.mark.xfail(reason=NOT_YET[k], strict=False)) if k in NOT_YET else k for k in FAULTS],
)
def test_each_fault_is_detected_localized_to_tensor_and_rank_and_dated_exactly(
    rows: dict[str, dict[str, Any]], kind: str
) -> None:
    r = rows[kind]
    assert r["detected"], r
    assert r["localized"], r
    assert r["exact"], r
    assert r["false_alarm_audits"] == 0, r
    assert r["repeated_transients"] == 0, r  # a transient report never repeats what an audit reported


@pytest.mark.parametrize("kind", [*HEALTHY, *CONTROLS])
def test_healthy_runs_and_equal_copies_raise_no_alarm(rows: dict[str, dict[str, Any]], kind: str) -> None:
    r = rows[kind]
    assert r["true_first_step"] is None, r  # the oracle agrees: nothing differs
    assert r["audits"] >= 4 and r["false_alarm_audits"] == 0 and not r["detected"], r


def test_the_table_has_a_line_per_kind_and_totals(rows: dict[str, dict[str, Any]]) -> None:
    text = summarize(list(rows.values()))
    for kind in [*FAULTS, *HEALTHY, *CONTROLS, "**all faulty**", "**all healthy**", "**all controls**"]:
        assert f" {kind} |" in text
    assert "median latency (steps)" in text and "localized tensor+rank" in text


def test_the_oracle_uses_the_contracts_reference_rule_and_localization_is_strict() -> None:
    assert odd_ranks([b"a", b"b"]) == [1]  # a tie goes to the group holding the lowest rank
    assert odd_ranks([b"b", b"a", b"a", b"a"]) == [0]
    assert odd_ranks([b"a", b"b", b"b", b"a"]) == [1, 2]
    assert odd_ranks([b"a"] * 4) == []
    truth = {"0.weight": [1]}
    assert covers("0.weight.requires_grad", "0.weight") and not covers("0.weights", "0.weight")
    assert localized([{"name": "0.weight", "ranks": [1]}], truth)
    assert not localized([{"name": "0.weight", "ranks": [0]}], truth)  # wrong rank
    assert not localized([{"name": "0.weight", "ranks": [1]}, {"name": "3.bias", "ranks": [1]}], truth)  # extra
    assert not localized([], truth)
    by_step = {5: {}, 6: {"0.weight": [1]}, 7: {}}
    assert not false_transient({"first_diverged_step": 6, "last_diverged_step": 6, "names": ["0.weight"]}, by_step)
    assert false_transient({"first_diverged_step": 7, "last_diverged_step": 7, "names": ["0.weight"]}, by_step)
    assert false_transient({"first_diverged_step": 6, "last_diverged_step": 6, "names": ["3.bias"]}, by_step)


def test_the_same_seed_draws_the_same_runs_and_faults_land_between_audits() -> None:
    assert plan([2, 4], 2, 5) == plan([2, 4], 2, 5)
    for kind in FAULTS:
        for n in range(20):
            s = make_spec(4, kind, n, 3)
            assert s.cadence < s.fault_step <= s.steps - s.cadence and 0 <= s.fault_rank < 4
            assert kind != "ckpt_rank0" or s.fault_rank == 0
    assert {make_spec(2, "healthy_every4", n, 0).cadence for n in range(8)} == {4}
    assert make_spec(2, "healthy_sampled_every5", 0, 0).coverage == "1/4"


def test_a_run_that_hangs_or_raises_is_reported_as_such_and_the_campaign_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import campaign_faults

    real_train = campaign_faults.train
    a, hangs, raises, d = (make_spec(2, "healthy_every4", n, SEED) for n in range(4))

    def train(spec: Any, rank: int, world: int) -> dict[str, Any]:  # the forked ranks inherit this patch
        if spec == hangs and rank == 1:
            time.sleep(3600)  # never reaches the next collective
        if spec == raises:
            raise RuntimeError("planted")
        return real_train(spec, rank, world)

    monkeypatch.setattr(campaign_faults, "train", train)
    rows = {r["run_id"]: r for r in execute([a, hangs, raises, d], run_timeout_s=5)}
    assert rows[hangs.run_id]["hang"] and not rows[hangs.run_id]["detected"]
    assert rows[raises.run_id]["error"] == "RuntimeError: planted" and not rows[raises.run_id]["hang"]
    for ok in (a, d):  # before and after the failures, in fresh sets of ranks
        assert not rows[ok.run_id]["hang"] and rows[ok.run_id]["error"] is None and rows[ok.run_id]["audits"] == 6
    lines = summarize(list(rows.values())).splitlines()
    header, healthy = ([c.strip() for c in line.split("|")[1:-1]] for line in (lines[0], lines[2]))
    cells = dict(zip(header, healthy))
    assert (cells["kind"], cells["runs"], cells["hangs"], cells["errors"]) == ("healthy_every4", "4", "1", "1")


@pytest.mark.parametrize(
    ("world", "kind", "run", "reported"),
    [
        # Run 3 of the seed: the state is lost in step 16 and the audit runs at 16, before Adam recreates it
        # (the case the scalar ``step`` alone cannot show: it is absent there, not different).
        (2, "fsdp1_state_lost", 3, {"fsdp1.optimizer_state_held._flat_param": [1]}),
        # Run 4 of the seed on 4 ranks (2 stages x 2 replicas): the parameter is frozen after step 8's optimizer
        # step and the audit runs at 8, where only the trainable flag differs within the stage's group.
        (4, "stage_replica_frozen", 4, None),
    ],
    ids=["fsdp1 state lost on one rank, named", "stage replica frozen"],
)
def test_a_partial_fault_is_found_at_the_audit_of_that_very_step(
    world: int, kind: str, run: int, reported: dict[str, list[int]] | None
) -> None:
    spec = make_spec(world, kind, run, SEED)
    assert spec.kind in PARTIAL and spec.fault_step % spec.cadence == 0
    (r,) = execute([spec], run_timeout_s=90)
    assert r["error"] is None and not r["hang"] and r["true_first_step"] == spec.fault_step, r
    assert r["detected"] and r["detected_step"] == spec.fault_step and r["localized"], r
    assert r["missed_audits"] == 0 and r["false_alarm_audits"] == 0, r  # no in-sync verdict while bytes differed
    if reported is not None:
        assert r["reported"] == reported, r["reported"]
    assert r["pinpoint"] == "unavailable" and not r["exact"], r  # never a date pinpoint cannot know


def test_expert_missing_on_one_rank_of_its_group_is_found_and_named_with_its_state() -> None:
    """Run 0 of the seed on 4 ranks: one rank loses its expert's bias (module and optimizer) after a step;
    the next audit names the bias and its Adam state on that rank only (the oracle compares within groups)."""
    spec = make_spec(4, "expert_missing", 0, SEED)
    assert spec.kind in PARTIAL
    (r,) = execute([spec], run_timeout_s=90)
    assert r["error"] is None and not r["hang"] and r["true_first_step"] == spec.fault_step, r
    assert r["detected"] and r["localized"] and r["missed_audits"] == 0 and r["false_alarm_audits"] == 0, r
    assert r["reported"] == {
        n: [spec.fault_rank] for n in ("3.bias", "3.bias.exp_avg", "3.bias.exp_avg_sq", "3.bias.step")
    }


# -- the combination campaign (benchmarks/campaign.py --pairs) ------------------------------------------------


@pytest.fixture(scope="module")
def pairs() -> dict[str, Any]:
    from campaign_pairs import report, run

    t0 = time.monotonic()
    out = run(SEED, "ci", timeout_s=120)
    print(report(out, "python benchmarks/campaign.py --pairs --slice ci", time.monotonic() - t0))
    return out


def test_the_design_covers_every_pair_once_seeded_and_never_an_impossible_one() -> None:
    rows = all_pairs(FACTORS, NOT_APPLICABLE, seed=3)
    assert rows == all_pairs(FACTORS, NOT_APPLICABLE, seed=3)  # the same seed, the same rows
    assert not uncovered(FACTORS, rows, NOT_APPLICABLE)
    order = list(FACTORS)
    assert not any(row_pairs(r, order) & set(NOT_APPLICABLE) for r in rows)
    levels = max(len(FACTORS["optimizer"]) * len(FACTORS["pattern"]), 45)
    assert levels <= len(rows) <= levels + 12  # close to the least any covering can have
    picked = each_value_once(FACTORS, rows)
    assert {(f, rows[i][f]) for i in picked for f in FACTORS} == {(f, v) for f in FACTORS for v in FACTORS[f]}
    cases = make_cases(rows, 0)
    assert len(cases) == 4 * len(rows) and {c.faulty_rank for c in cases} == {None, 0, 1}
    for (
        c
    ) in cases:  # the second fault of fault01: found by the audit (every 2 steps) after the one that finds the first
        assert c.variant != "fault01" or c.plants() == [(0, c.fault_step), (1, c.fault_step + c.fault_step % 2 + 2)]
    assert all(4 <= c.fault_step <= 7 < STEPS for c in cases)


def test_the_ci_slice_runs_every_value_of_every_factor_without_a_hang(pairs: dict[str, Any]) -> None:
    results = pairs["results"]
    ran = [r for r in results if not r["refused"]]
    assert {(f, r["case"][f]) for r in ran for f in FACTORS} == {(f, v) for f in FACTORS for v in FACTORS[f]}
    assert len(results) == 4 * len(pairs["picked"]) and not any(r["hang"] for r in results)
    assert all(r["records"] >= 4 for r in ran if not r["crash"] and not r["raised"]), [r["run_id"] for r in ran]


def test_the_oracle_sees_nothing_in_healthy_runs_and_each_fault_at_its_step(pairs: dict[str, Any]) -> None:
    for r in pairs["results"]:
        c = r["case"]
        if r["refused"] or r["crash"]:
            continue
        if c["variant"] == "healthy":
            assert r["truth_first"] is None, r  # the oracle agrees: nothing differed at any step
        else:
            assert r["truth_first"] == c["fault_step"], r  # the planted fault, at its step, on its rank


UNDECIDED_BY_DESIGN = {
    ("pattern", "clamp"): "a post-step clamp writes at rest on every rank: a flip beside it leaves no rank's own "
    "record standing out, and with 2 ranks nothing else decides (docs/reliability.md, 9c)",
    ("optimizer", "lbfgs"): "a closure optimizer's update cannot be replayed from copies: a compute fault inside "
    "it is undecided, and the record says why",
}
"""Where an undecided blame is the honest answer (never a false one): the record says why, and no repair
follows from it on evidence it does not have."""


@pytest.mark.parametrize("column", COLUMNS)
def test_no_run_of_the_ci_slice_fails_this_column(pairs: dict[str, Any], column: str) -> None:
    def excused(r: dict[str, Any]) -> bool:
        return column == "blame undecided" and any(r["case"][f] == v for f, v in UNDECIDED_BY_DESIGN)

    bad = [
        f"{r['run_id']} {r['describe']}: {r['detail'][:2]}" for r in pairs["results"] if r[column] and not excused(r)
    ]
    assert bad == [], "\n".join(bad)
    if column == "blame undecided":  # an excused one still says why it could not decide
        assert all("undecided at" in d for r in pairs["results"] if r[column] for d in r["detail"][:1])


def _truth(world: int, values: dict[str, dict[tuple[str, int], list[int]]]) -> dict[str, Any]:
    """A gathered truth by hand: per tensor and point, each rank's class of bytes."""
    classes = {("param", n): {(lbl, s, r): v for (lbl, s), vs in pts.items() for r, v in enumerate(vs)}
               for n, pts in values.items()}  # fmt: skip
    points = sorted({p for pts in values.values() for p in pts}, key=lambda p: (p[1], "QPEX".index(p[0])))
    return {"classes": classes, "points": points, "nbytes": dict.fromkeys(classes, 64)}


def _one(world: int, variant: str, **kw: Any) -> Case:
    row = {f: v[0] for f, v in FACTORS.items()} | {"world": world} | kw
    return replace(next(c for c in make_cases([row], 0) if c.variant == variant), fault_step=4)


def _record(step: int, names: list[str], ranks: list[int], tie: bool = False, **extra: Any) -> dict[str, Any]:
    said = {"detail": "tie vote: no majority"} if tie else {}  # as the library words a vote with no majority
    mism = [{"name": n, "kind": "param", "ranks": ranks, **said} for n in names]
    return {"step": step, "in_sync": not names, "action": extra.pop("action", "warned" if names else "none"),
            "mismatches": mism, "checked": {"param": 2}, **extra}  # fmt: skip


def test_the_scoring_catches_each_failure_it_names() -> None:
    """The columns computed from a truth built by hand: each failure the scorer exists for is counted."""
    steady = {("E", 2): [0, 0, 0], ("X", 2): [0, 0, 0], ("E", 4): [0, 0, 0], ("X", 4): [0, 0, 0]}
    healthy = _truth(3, {"a": steady, "b": steady})
    case = _one(3, "healthy")
    ok = score(case, {"statuses": [{}] * 3, "truth": healthy, "records": [_record(2, [], []), _record(4, [], [])]})
    assert not any(ok[c] for c in COLUMNS), ok
    alarm = score(case, {"statuses": [{}] * 3, "truth": healthy, "records": [_record(4, ["a"], [1])]})
    assert alarm["false alarm"] == 1
    # rank 1 corrupted at step 4 (3 ranks: the majority is the truth); the resync took rank 1's bytes
    bad = {("E", 2): [0, 0, 0], ("X", 2): [0, 0, 0], ("E", 4): [0, 1, 0], ("X", 4): [1, 1, 1]}
    fault = _truth(3, {"a": bad, "b": steady})
    case = _one(3, "fault1", on_mismatch="resync", attribution=True)
    blame = {"ranks": [0], "evidence": "at_rest_change", "hardware_suspect": True}
    rec = _record(4, ["a"], [1], action="resynced", blame=blame)
    row = score(case, {"statuses": [{}] * 3, "truth": fault, "records": [_record(2, [], []), rec]})
    assert (row["false blame"], row["repair from corrupted"], row["fault not named"]) == (1, 1, 0), row
    kept = _truth(3, {"a": {**bad, ("X", 4): [0, 1, 0]}, "b": steady})  # no repair: rank 1 still differs
    missed = score(case, {"statuses": [{}] * 3, "truth": kept, "records": [_record(2, [], []), _record(4, [], [])]})
    assert missed["false all-clear"] == 1 and missed["fault not named"] == 1
    # two ranks, no attribution: a repair from the corrupted rank is a tie nothing could break (not a failure)
    two = _truth(2, {"a": {("E", 4): [1, 0], ("X", 4): [1, 1]}})
    case = _one(2, "fault0", on_mismatch="resync")
    rec = _record(4, ["a"], [1], tie=True, action="resynced")
    row = score(case, {"statuses": [{}] * 2, "truth": two, "records": [rec]})
    assert row["tie repair"] == 1 and not any(row[c] for c in FAILURES), row
    # three ranks that all differ (two faults, elsewhere in one tensor): no majority either
    three = _truth(3, {"a": {("E", 4): [1, 2, 0], ("X", 4): [1, 1, 1]}})
    rec = _record(4, ["a"], [1, 2], tie=True, action="resynced")
    row = score(_one(3, "fault01", on_mismatch="resync"), {"statuses": [{}] * 3, "truth": three, "records": [rec]})
    assert row["tie repair"] == 1 and not any(row[c] for c in FAILURES), row
    # with attribution undecided, the same: its own column says the blame named no one
    case = _one(2, "fault0", on_mismatch="resync", attribution=True)
    undecided = {"ranks": [], "evidence": "undecided"}
    rec = _record(4, ["a"], [1], tie=True, action="resynced", blame=undecided)
    row = score(case, {"statuses": [{}] * 2, "truth": two, "records": [rec]})
    assert row["tie repair"] == 1 and row["repair from corrupted"] == 0 and row["blame undecided"] == 1, row
    # but a blame that names a rank, then a copy from the corrupted one, is a failure on two ranks too
    rec = _record(4, ["a"], [1], tie=True, action="resynced", blame={"ranks": [1], "evidence": "at_rest_change"})
    row = score(case, {"statuses": [{}] * 2, "truth": two, "records": [rec]})
    assert row["repair from corrupted"] == 1 and row["tie repair"] == 0, row
    hang = score(case, "hang")
    assert hang["hang"] == 1


@pytest.mark.parametrize("hook", ["before_optimizer_step", "on_before_optimizer_step", "on_pre_optimizer_step"])
def test_the_scoring_reads_every_adapters_gradient_audit_before_the_update_it_numbers(hook: str) -> None:
    """LoopAudit's, Lightning's and the HF Trainer's pre-step records are judged on ``Q``/``P`` of their step:
    an in-sync one there, before the fault's update, is no false all-clear (the HF hook was read as after-step)."""
    parted = {("Q", 4): [0, 0, 0], ("P", 4): [0, 0, 0], ("E", 4): [1, 2, 2], ("X", 4): [1, 2, 2]}
    truth = _truth(3, {"a": parted})
    case = _one(3, "fault0", grads=True)
    row = score(case, {"statuses": [{}] * 3, "truth": truth, "records": [_record(4, [], [], hook=hook)]})
    assert not any(row[c] for c in FAILURES), row
    after = score(case, {"statuses": [{}] * 3, "truth": truth, "records": [_record(4, [], [], hook="step")]})
    assert after["false all-clear"] == 1, after


def test_a_learning_rate_named_right_before_the_update_counts_as_the_planted_one_at_that_step() -> None:
    """A gradient audit after a closure (LBFGS) reads the lr the step's pre-step hooks set: naming it there, on
    the rank it was planted on, is the fault named (the oracle keeps no hyper-parameter at ``Q``, ``P``)."""
    truth = _truth(3, {"a": {("Q", 4): [0, 0, 0], ("P", 4): [0, 0, 0]}})
    lr = {"name": "param_groups.0.lr", "kind": "optimizer", "ranks": [0], "reference_ranks": [1, 2]}
    rec = {**_record(4, [], [], hook="before_optimizer_step"), "in_sync": False, "mismatches": [lr]}
    rec["blame"] = {"ranks": [0], "evidence": "vote"}
    row = score(_one(3, "fault0", fault="lr"), {"statuses": [{}] * 3, "truth": truth, "records": [rec]})
    assert not any(row[c] for c in FAILURES), row
    other = score(_one(3, "fault1", fault="lr"), {"statuses": [{}] * 3, "truth": truth, "records": [rec]})
    assert other["false alarm"] == 1 and other["false blame"] == 1, other  # planted on rank 1, not rank 0


def test_a_duplicate_batch_is_expected_in_a_note_only_once_an_audit_after_its_step_ran() -> None:
    """A run that raised at the gradient audit before step d's update never handed over step d's batch."""
    same = {("B", 6): [0, 0, 1], ("E", 6): [0, 0, 0], ("X", 6): [0, 0, 0]}
    truth = _truth(3, {"a": {("E", 6): [0, 0, 0], ("X", 6): [0, 0, 0]}})
    truth["classes"][("batch", "batch")] = {(lbl, s, r): v for (lbl, s), vs in same.items() for r, v in enumerate(vs)}
    truth["points"] = sorted({*truth["points"], ("B", 6)}, key=lambda p: (p[1], "BQPEX".index(p[0])))
    case = replace(_one(3, "healthy", check_batches=True), dup_step=6)
    before = score(
        case, {"statuses": [{}] * 3, "truth": truth, "records": [_record(6, [], [], hook="before_optimizer_step")]}
    )
    assert before["duplicate batch not noted"] == 0, before
    after = score(case, {"statuses": [{}] * 3, "truth": truth, "records": [_record(6, [], [], hook="step")]})
    assert after["duplicate batch not noted"] == 1, after


def test_a_gradient_changed_on_one_rank_after_the_all_reduce_is_named_and_repaired_under_resync() -> None:
    """``LoopAudit`` with ``include`` grads, 3 ranks, ``resync`` (issue 48 item 2, a focus row): the gradient
    audit before the next step finds the optimizer state the changed gradient left on one rank and repairs it;
    it used to confirm against the parameters it had not compared, and raise."""
    from campaign_pairs import run

    out = run(SEED, "full", only=[{"fault": "grad", "grads": True, "on_mismatch": "resync", "world": 3}])
    assert len(out["results"]) == 4
    bad = [(r["run_id"], [c for c in FAILURES if r[c]], r["detail"][:2]) for r in out["results"]]
    assert [b for b in bad if b[1]] == [], bad
