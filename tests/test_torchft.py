"""torchft replica groups audited across the quorum: real lighthouse, real Managers, real heals, on CPU gloo.

Each job runs replica groups as separate processes (tests/torchft_jobs.py); each process returns its
records and the state it held at every audit point, so the truth is computed here from the bytes, never
from the records: replicas equal or not (``torch.equal``), and between LocalSGD syncs different.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("torchft") is None:  # not imported here: each replica process imports it itself
    pytest.skip("the torchft extra: pip install 'weightsync-audit[torchft]'", allow_module_level=True)

from ranks import run_ranks
from torchft_jobs import Replica, run_job

import weightsync_audit
from weightsync_audit import AuditResult
from weightsync_audit.integrations.torchft import TorchFTAudit

PARAMS = ["0.weight", "0.bias", "2.weight", "2.bias"]


def _same_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Every member's record of one audit is the same (but for the time and the duration); returns it."""
    strip = [{k: v for k, v in r.items() if k not in ("time", "duration_ms")} for r in records]
    differ = {
        k: [s.get(k) for s in strip] for s in strip for k in set(s) | set(strip[0]) if s.get(k) != strip[0].get(k)
    }
    assert not differ, differ
    AuditResult.from_dict(records[0])  # and it reads back as a valid record
    return records[0]


def _by_step(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in result["records"]}


def _equal(a: dict[str, Any], b: dict[str, Any], keys: list[str] | None = None) -> bool:
    keys = sorted(set(a) | set(b)) if keys is None else keys
    return all(
        k in a and k in b and (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])
        for k in keys
    )


@pytest.mark.parametrize("name", ["", ".compat", ".channel", ".verdict"])
def test_the_examples_in_the_docstrings_run(name: str) -> None:
    module = importlib.import_module(f"weightsync_audit.integrations.torchft{name}")
    failed, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert tried and not failed


def test_neither_the_core_nor_the_integration_imports_torchft() -> None:
    code = (
        "import sys, weightsync_audit, weightsync_audit.integrations.torchft; weightsync_audit.audit(None);"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torchft']; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    root = Path(weightsync_audit.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "torchft" for n in names), path


def test_what_cannot_work_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="resync"):
        TorchFTAudit(object(), torch.nn.Linear(2, 2), object(), on_mismatch="resync")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sync= and optimizer="):
        TorchFTAudit(object(), optimizer=object(), sync=object())
    with pytest.raises(ValueError, match="optimizer="):
        TorchFTAudit(object(), torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="torchft.manager.Manager"):
        TorchFTAudit(object(), torch.nn.Linear(2, 2), object())
    with pytest.raises(ValueError, match=r"overlap=True: not offered under TorchFTAudit: a heal .* coverage='1/n'"):
        TorchFTAudit(object(), torch.nn.Linear(2, 2), object(), overlap=True)


def test_a_healthy_run_of_three_replica_groups_is_quiet() -> None:
    res = run_job([Replica(0), Replica(1), Replica(2)], steps=6)
    steps = sorted(_by_step(res[(0, 0)]))
    assert steps == [0, 2, 4]  # the first quorum, then every 2 committed steps
    for step in steps:
        record = _same_record([_by_step(res[(i, 0)])[step] for i in range(3)])
        truth = [res[(i, 0)]["snapshots"][step] for i in range(3)]
        assert _equal(truth[0], truth[1]) and _equal(truth[0], truth[2])  # the bytes agree: so must the record
        assert record["in_sync"] and record["world_size"] == 3 and record["action"] == "none"
        assert record["checked"]["param"] == 4 and record["checked"]["optimizer"] > 12
        assert sorted(record["torchft"]["replicas"]) == ["0", "1", "2"] and record["torchft"]["absent"] == []
        assert any("dataloader position" in n for n in record["notes"])  # per replica by design: said, not compared
    # The summaries rode the roll call: healthy audits opened no gloo group (a divergent one does: below).
    assert [res[(i, 0)]["groups"] for i in range(3)] == [0, 0, 0]


def test_hsdp_each_shard_is_compared_among_its_own_replicas() -> None:
    """HSDP under torchft: FSDP2 shards the model within each replica group (2 ranks), torchft averages each
    shard across the groups. Group rank r audits with group rank r of the other group. One element of replica
    1's shard on group rank 1 moved: named there (its shard and global shape), and only there."""
    res = run_job([Replica(0, group_size=2), Replica(1, group_size=2, extra={"nudge": (1, 3)})], mode="hsdp", steps=6)
    at = 4
    shard0 = [res[(i, 0)]["snapshots"][at] for i in range(2)]
    shard1 = [res[(i, 1)]["snapshots"][at] for i in range(2)]
    assert _equal(shard0[0], shard0[1])
    assert not torch.equal(shard0[0]["p:0.weight"], shard1[0]["p:0.weight"])  # the two shards hold other rows
    differ = [k for k in shard1[0] if k.startswith("p:") and not torch.equal(shard1[0][k], shard1[1][k])]
    assert differ == ["p:0.weight"]
    gap = (shard1[1]["p:0.weight"] - shard1[0]["p:0.weight"]).abs().max().item()

    r0 = _same_record([_by_step(res[(i, 0)])[at] for i in range(2)])
    r1 = _same_record([_by_step(res[(i, 1)])[at] for i in range(2)])
    assert r0["in_sync"] and r0["torchft"]["group_rank"] == 0
    assert r1["torchft"]["group_rank"] == 1 and not r1["in_sync"]
    [m] = r1["mismatches"]
    assert (m["name"], m["ranks"], m["reference_ranks"], m["shard"]) == ("0.weight", [1], [0], {"shard": 1})
    assert m["shape"] == [64, 4] and m["max_abs_diff"] == pytest.approx(gap)
    assert all(r["in_sync"] for r in res[(0, 1)]["records"] if r["step"] < at)


def test_on_mismatch_raise_raises_out_of_the_optimizer_step_on_every_replica_compared() -> None:
    res = run_job([Replica(0), Replica(1, extra={"nudge": (0, 3)})], steps=6, on_mismatch="raise")
    a, b = res[(0, 0)]["snapshots"][4], res[(1, 0)]["snapshots"][4]
    assert [k for k in a if k.startswith("p:") and not torch.equal(a[k], b[k])] == ["p:0.weight"]
    record = _same_record([res[(i, 0)]["raised"] for i in range(2)])
    assert record["step"] == 4 and record["action"] == "raised"
    assert [(m["name"], m["ranks"]) for m in record["mismatches"]] == [("0.weight", [1])]
    # Both raised in the pre-hook of the step after 4: the Manager had counted it (5), the update never ran.
    assert all(res[(i, 0)]["step"] == 5 for i in range(2))


def _heal_job(restarted: dict[str, Any], **extra: Any) -> tuple[dict[Any, Any], int]:
    res = run_job([Replica(0, extra=extra), Replica(1, die_at=3, restarted=restarted, extra=extra)], steps=7)
    healed = min(res[(1, 0)]["snapshots"])  # the restarted group's first committed step
    return res, healed


def test_a_killed_group_heals_and_is_verified_before_its_first_committed_step() -> None:
    res, at = _heal_job({})
    source, healed = res[(0, 0)]["snapshots"][at], res[(1, 0)]["snapshots"][at]
    assert _equal(source, healed)  # torchft's heal restored everything, the scheduler included
    record = _same_record([_by_step(res[(i, 0)])[at] for i in range(2)])
    assert record["in_sync"] and record["torchft"]["healed"] == {"1": {"source": 0, "verified": True, "differs": []}}
    assert any(
        "healed from replica 0" in n and "verified before its first committed step" in n for n in record["notes"]
    )
    assert record["checked"]["optimizer"] > 12  # optimizer state, the Manager's counters and the scheduler's
    assert record["checked"]["buffer"] == 1  # the declared must_match counter (the model has no buffers)
    assert _equal(res[(0, 0)]["snapshots"][6], res[(1, 0)]["snapshots"][6])
    assert all(r["in_sync"] for r in res[(1, 0)]["records"])


def test_a_post_heal_difference_is_named() -> None:
    """The restarted group's load_state_dict skips the optimizer and the user's own batch counter (declared
    with must_match), and no group sends its lr scheduler."""
    res, at = _heal_job({"skip_optimizer": True, "forget_seen": True}, scheduler_in_state=False)
    source, healed = res[(0, 0)]["snapshots"][at], res[(1, 0)]["snapshots"][at]
    assert _equal(source, healed, [k for k in source if k.startswith("p:")])  # the parameters were healed
    wrong = set()
    for key in sorted(set(source) | set(healed)):
        if key.startswith("o:") and not _equal(source, healed, [key]):
            _, index, state = key.split(":")
            wrong.add(f"{PARAMS[int(index)]}.{state}")
    assert source["s:last_epoch"] != healed["s:last_epoch"]
    wrong |= {"lr_scheduler.last_epoch", "batches_seen"}
    assert len(wrong) == 14

    record = _same_record([_by_step(res[(i, 0)])[at] for i in range(2)])
    heal = record["torchft"]["healed"]["1"]
    assert heal["source"] == 0 and heal["verified"] is False
    assert wrong <= set(heal["differs"]) and not set(heal["differs"]) & set(PARAMS)
    assert {r for m in record["mismatches"] for r in m["ranks"]} == {1}
    assert record["blame"]["ranks"] == [1] and "healed from replica 0" in record["blame"]["detail"]
    assert "does not restore the optimizer" in record["hints"][0]
    assert any("lr scheduler" in h and "register_state_dict_fn" in h for h in record["hints"])
    assert any(h.startswith("Declared state (batches_seen) differs on the healed replica") for h in record["hints"])


def test_a_group_that_leaves_is_followed() -> None:
    """Three groups; group 2 is killed at step 3 and not restarted. The quorum shrinks to groups 0 and 1,
    and their next committed step is audited among the two of them, under the new quorum."""
    res = run_job([Replica(0), Replica(1), Replica(2, die_at=3, restarted=None)], steps=6, every=100, min_replicas=2)
    assert (2, 0) not in res
    assert sorted(_by_step(res[(0, 0)])) == sorted(_by_step(res[(1, 0)])) == [0, 3]
    records = [_same_record([_by_step(res[(i, 0)])[step] for i in range(2)]) for step in (0, 3)]
    assert (records[0]["world_size"], records[0]["in_sync"]) == (3, True)
    after = records[-1]
    assert after["world_size"] == 2 and sorted(after["torchft"]["replicas"]) == ["0", "1"] and after["in_sync"]
    assert after["torchft"]["quorum_id"] != records[0]["torchft"]["quorum_id"]
    assert _equal(res[(0, 0)]["snapshots"][after["step"]], res[(1, 0)]["snapshots"][after["step"]])


def test_a_replica_that_does_not_come_is_named_and_not_waited_for() -> None:
    """Replica 1 audits at quorum changes (and every 1000 steps); replica 0 every 2 steps. At step 2 replica 0 waits its
    timeout_s for replica 1, then audits the replicas present and says who was absent; the run goes on."""
    res = run_job([Replica(0), Replica(1, extra={"every": 1000})], steps=5, timeout_s=1.0)
    alone = _by_step(res[(0, 0)])[2]
    assert alone["torchft"]["absent"] == [1] and alone["world_size"] == 1 and alone["in_sync"]
    assert any("did not come to this audit within 1s" in n for n in alone["notes"])
    assert alone["duration_ms"] < 1000 * (1.0 + 5.0)
    assert sorted(_by_step(res[(1, 0)])) == [0] and res[(1, 0)]["step"] == 5


def _sync_truth(res: dict[Any, Any], steps: int, every: int) -> None:
    """At a sync the replicas hold the same parameters; between syncs they differ (by design)."""
    a, b = res[(0, 0)]["snapshots"], res[(1, 0)]["snapshots"]
    for local in range(1, steps + 1):
        params = [k for k in a[local] if k.startswith("p:")]
        assert _equal(a[local], b[local], params) == (local % every == 0), local


def test_local_sgd_is_audited_at_sync_points_only() -> None:
    res = run_job([Replica(0), Replica(1)], mode="localsgd", steps=9, sync_every=3, every=1)
    _sync_truth(res, 9, 3)  # an audit between syncs would find every parameter different: none runs there
    records = [_same_record([_by_step(res[(i, 0)])[s] for i in range(2)]) for s in (1, 2, 3)]
    assert sorted(_by_step(res[(0, 0)])) == [1, 2, 3]  # the manager's step counts syncs: one record per sync
    for record in records:
        assert record["in_sync"] and record["hook"] == "localsgd_sync" and record["checked"]["param"] == 4
        assert record["torchft"]["sync"] == {"algorithm": "LocalSGD", "every": 3, "between_syncs": "not audited"}
        assert any(n.startswith("audited at a LocalSGD sync point") and "no audit runs" in n for n in record["notes"])
        # torchft healed replica 1 at its first quorum (step 0); the state it loaded has trained and synced since
        assert record["torchft"]["healed"] == {} and not any("verified" in n for n in record["notes"])
    assert any("healed from replica 0 before this sync" in n for n in records[0]["notes"])


def test_a_difference_at_a_local_sgd_sync_is_found() -> None:
    """Replica group 1 was launched with torchft's spare-replica mode: it counts itself out of the average
    and copies replica 0's parameters undivided. Its parameters differ from the first sync on: the sync's
    doing, not the heal's at the first quorum (whose state the sync replaced)."""
    res = run_job([Replica(0), Replica(1, extra={"spares": True})], mode="localsgd", steps=6, sync_every=3, every=1)
    a, b = res[(0, 0)]["snapshots"][3], res[(1, 0)]["snapshots"][3]
    assert not any(torch.equal(a[f"p:{n}"], b[f"p:{n}"]) for n in PARAMS)
    record = _same_record([_by_step(res[(i, 0)])[1] for i in range(2)])
    assert not record["in_sync"] and record["action"] == "warned"
    named = {m["name"]: m for m in record["mismatches"]}
    assert {n: named[n]["ranks"] if n in named else None for n in PARAMS} == {n: [1] for n in PARAMS}
    # 0.weight (1 KiB) went over the quorum channel's data plane: its gap is the one in the bytes.
    assert named["0.weight"]["max_abs_diff"] == pytest.approx((a["p:0.weight"] - b["p:0.weight"]).abs().max().item())
    blame = record["blame"]
    assert (blame["evidence"], blame["ranks"], blame["step"]) == ("collective_mismatch", [], 1)  # two: a tie
    assert "LocalSGD sync committed at step 1" in blame["detail"] and "heal" not in blame["detail"]
    assert record["torchft"]["healed"] == {} and not any("healed replica" in h for h in record["hints"])
    assert not any("first committed step" in n for n in record["notes"])


def test_a_flip_in_one_replicas_first_sync_is_blamed_on_that_replica_by_the_vote_not_on_its_heal() -> None:
    """Three groups; replicas 1 and 2 healed from replica 0 at the first quorum. One bit of replica 2's
    all-reduced 2.weight is flipped at the first sync: the sync's doing, named by the other two."""
    from weightsync_audit.integrations.evict import evict_targets

    fault = {"sync": 1, "param": 2, "element": 5, "bit": 20}
    reps = [Replica(0), Replica(1), Replica(2, extra={"sync_fault": fault})]
    res = run_job(reps, mode="localsgd", steps=6, sync_every=3, every=1)
    snaps = [res[(i, 0)]["snapshots"][3] for i in range(3)]
    assert [n for n in PARAMS if not torch.equal(snaps[0][f"p:{n}"], snaps[2][f"p:{n}"])] == ["2.weight"]
    assert _equal(snaps[0], snaps[1]) and _equal(res[(0, 0)]["snapshots"][6], res[(2, 0)]["snapshots"][6])
    record = _same_record([_by_step(res[(i, 0)])[1] for i in range(3)])
    rank = next(int(r) for r, rid in record["torchft"]["replicas"].items() if rid.startswith("replica2:"))
    assert [(m["name"], m["ranks"]) for m in record["mismatches"]] == [("2.weight", [rank])]
    blame = record["blame"]
    assert (blame["evidence"], blame["ranks"]) == ("collective_mismatch", [rank]) and "heal" not in blame["detail"]
    assert record["torchft"]["healed"] == {} and any(
        "healed from replica 0 before this sync" in n for n in record["notes"]
    )
    assert sorted(evict_targets(AuditResult.from_dict(record), exiting=True)) == [rank]
    assert _same_record([_by_step(res[(i, 0)])[2] for i in range(3)])["in_sync"]


def test_diloco_is_audited_at_sync_points_only() -> None:
    res = run_job([Replica(0), Replica(1)], mode="diloco", steps=6, sync_every=3, every=1)
    _sync_truth(res, 6, 3)
    for step in (1, 2):
        record = _same_record([_by_step(res[(i, 0)])[step] for i in range(2)])
        assert record["in_sync"] and record["hook"] == "diloco_sync"
        # the live parameters, the global copy (buffers) and the outer optimizer's momentum, all compared
        assert record["checked"]["param"] == 4 and record["checked"]["buffer"] == 4
        assert record["torchft"]["sync"]["fragment"] == 0


def _loop_rank(rank: int, world: int, report: str, coverage: str = "1") -> dict[str, Any]:
    """The same job under LoopAudit: two ranks of one torch DDP group, the same model, optimizer, scheduler and
    cadence, the same fault planted (rank 1's ``0.weight`` moved after step 3), the first state audited too."""
    from weightsync_audit import LoopAudit

    torch.manual_seed(100)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(rank)
    audit = LoopAudit(ddp, opt, every_n_steps=2, timeout_s=5.0, verbose=False, report_path=report, coverage=coverage)
    records = [audit.audit(0, hook="step")]
    for step in range(1, 6):
        opt.zero_grad()
        ddp(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
        opt.step()
        sched.step()
        if (rank, step) == (1, 3):
            with torch.no_grad():
                model[0].weight[0, 0] += 1e-3
        records.append(audit.step(step))
    audit.close()
    return {"records": [r.to_dict() for r in records if r is not None], "summary": audit.summary()}


def _verdict(record: dict[str, Any]) -> tuple[Any, ...]:
    """What an option decides in a record, whichever adapter took it."""
    blame = record.get("blame") or {}
    mismatches = [(m["kind"], m["name"], m["ranks"], m["reference_ranks"], m["shape"]) for m in record["mismatches"]]
    blamed = (blame.get("ranks"), blame.get("evidence"), blame.get("cause"))
    return record["step"], record["in_sync"], record["action"], record["last_in_sync_step"], mismatches, blamed


@pytest.mark.parametrize("coverage", ["1", "1/2"])
def test_an_option_means_under_torchft_what_it_means_under_loop_audit(tmp_path: Path, coverage: str) -> None:
    """One session for every adapter: the same fault gives TorchFTAudit and LoopAudit the same verdicts (what
    differs, where, the action, the blame), the same report written to report_path, the same summary; under
    ``coverage="1/2"`` the cadence audits read the same slices (the first quorum's audit reads every byte)."""
    from weightsync_audit.reporting.jsonl import read_report

    report = str(tmp_path / "ft-{index}.jsonl")
    options = {"options": {"coverage": coverage}} if coverage != "1" else {}
    res = run_job([Replica(0), Replica(1, extra={"nudge": (0, 3)})], steps=6, report=report, **options)
    loop = run_ranks(_loop_rank, 2, str(tmp_path / "loop.jsonl"), coverage)[0]
    sliced = [r.get("coverage") for r in res[(0, 0)]["records"]]
    assert sliced == ([None, None, None] if coverage == "1" else [None, "2/2", "1/2"])
    assert [r.get("coverage") for r in loop["records"]][1:] == sliced[1:]
    ft = res[(0, 0)]
    assert [_verdict(r) for r in ft["records"]] == [_verdict(r) for r in loop["records"]]
    assert [r["step"] for r in ft["records"] if not r["in_sync"]] == [4]
    assert ft["groups"] > 0  # the divergence was localized over a gloo group of the replicas
    for records, path in ((ft["records"], tmp_path / "ft-0.jsonl"), (loop["records"], tmp_path / "loop.jsonl")):
        assert [r.to_dict() for _, r in read_report(path).records] == records
    assert ft["summary"] == loop["summary"] and "first at step 4 (0.weight)" in ft["summary"]


def test_include_grads_compares_the_gradients_after_the_all_reduce_in_the_audit_before_the_step() -> None:
    res = run_job([Replica(0), Replica(1)], steps=3, options={"include": ("params", "optimizer", "grads")})
    records = [_same_record([_by_step(res[(i, 0)])[step] for i in range(2)]) for step in (0, 2)]
    assert records[1]["checked"]["grad"] == 4 and records[1]["checked"]["param"] == 4
    assert all(r["in_sync"] for r in records)


def test_coverage_reads_a_slice_that_follows_the_committed_step_the_same_on_every_replica() -> None:
    """``coverage="1/4"``, an audit every committed step, 0.weight 128 KiB (sliced; a small tensor is read whole).
    Replica 1's ``0.weight[0, 0]`` (slice 1 of 4) moved after step 3: the audit of step 3 reads slice 4 and
    misses it, the next one (slice 1) names it; the first quorum's audit read every byte."""
    res = run_job([Replica(0), Replica(1, extra={"nudge": (0, 3)})], steps=5, every=1, width=8192,
                  options={"coverage": "1/4"})  # fmt: skip
    truth = [res[(i, 0)]["snapshots"] for i in range(2)]
    assert _equal(truth[0][2], truth[1][2]) and not _equal(truth[0][3], truth[1][3], ["p:0.weight"])
    records = {s: _same_record([_by_step(res[(i, 0)])[s] for i in range(2)]) for s in range(5)}
    assert "coverage" not in records[0] and records[0]["last_full_sync_step"] == 0  # a quorum change: in full
    assert [records[s].get("coverage") for s in range(1, 5)] == ["2/4", "3/4", "4/4", "1/4"]
    assert [records[s]["in_sync"] for s in range(5)] == [True, True, True, True, False]
    assert [(m["name"], m["ranks"]) for m in records[4]["mismatches"]] == [("0.weight", [1])]
    assert records[3]["last_full_sync_step"] == 0 and records[4]["last_in_sync_step"] == 3


def test_under_coverage_replicas_that_would_read_otherwise_read_again_in_full_together() -> None:
    """Replica 1's audit is made at step 1: it saw no quorum before, so it reads every byte there, while replica
    0 reads slice 2 of 4. The roll shows it: both read step 1 again in full, and the next audits a slice alike."""
    res = run_job([Replica(0), Replica(1, extra={"audit_from": 1})], steps=3, every=1, width=8192, timeout_s=1.0,
                  options={"coverage": "1/4"})  # fmt: skip
    assert sorted(_by_step(res[(1, 0)])) == [1, 2]
    again = _same_record([_by_step(res[(i, 0)])[1] for i in range(2)])
    assert "coverage" not in again and again["world_size"] == 2 and again["in_sync"]
    assert again["last_full_sync_step"] == 1 and not any("failed" in n for n in again["notes"])
    assert _same_record([_by_step(res[(i, 0)])[2] for i in range(2)])["coverage"] == "3/4"


def test_under_coverage_a_heal_is_verified_reading_every_byte() -> None:
    res, at = _heal_job({}, width=8192, options={"coverage": "1/4"})
    record = _same_record([_by_step(res[(i, 0)])[at] for i in range(2)])
    assert "coverage" not in record and record["last_full_sync_step"] == at
    assert record["torchft"]["healed"] == {"1": {"source": 0, "verified": True, "differs": []}}
    sampled = [r for r in res[(1, 0)]["records"] if r["step"] > at]
    assert sampled and all(r.get("coverage") for r in sampled) and all(r["in_sync"] for r in sampled)


def test_the_roll_call_gives_up_on_a_stopped_store_within_its_bound_and_the_next_one_goes_on() -> None:
    """The quorum's store served by a process that is stopped (SIGSTOP): the roll's calls block, and the roll
    gives up within its bound; the next roll, on a store that answers, completes (on a thread of its own). The
    thread left in the abandoned call ends once the store's process is gone (the test waits for it: one left
    retrying the dead store in this process hung the next test's forked ranks in a full run, stop 60)."""
    import os
    import signal
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from weightsync_audit.errors import AuditTimeoutError
    from weightsync_audit.integrations.torchft.channel import Member, call_roll

    code = (
        "import sys, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True); "
        "print(s.port, flush=True); sys.stdin.read()"
    )
    threads, left = set(threading.enumerate()), set()
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=3))
        os.kill(server.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(AuditTimeoutError, match="did not answer"):
            call_roll(client, "a", Member(0, "r0"), 2, wait_s=0.5, bound_s=1.0)
        assert time.monotonic() - t0 < 3.0
        left = set(threading.enumerate()) - threads  # the thread left in the stopped store's call
        roll = call_roll(dist.HashStore(), "b", Member(0, "r0"), 1, wait_s=0.5, bound_s=1.0)
        assert roll.position == 0 and roll.ranks == (0,) and roll.absent == ()
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()
        for thread in left:
            thread.join(timeout=20)
    assert left and not [t.name for t in left if t.is_alive()]
