"""Lightning's ``DeepSpeedStrategy`` (ZeRO-2, ZeRO-3) and ``FSDPStrategy`` (FSDP1 FULL_SHARD), audited end to end.

A real ``pytorch_lightning.Trainer`` on 2 CPU gloo ranks (``torchrun`` twice, two one-process nodes, as in
tests/test_replicas_trainers.py) fits a small model under each strategy with the ``WeightSyncAudit``
callback; the strategies are Lightning's own, less their device checks (tests/sharded_strategies.py). One
launch runs every fit (tests/scripts/lightning_sharded_run.py): the audits of steps 0 and 2 see a healthy
run, then 1 is added on rank 1 to replicated tensors right before the audit of step 4 (and of the checkpoint
Lightning saves at the epoch's end, whose sidecar says it diverged). What has one owner
(ZeRO partitions, FSDP1 shards) is named in the record's note and never counted in ``checked``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")

from torchrun import ROOT, two_node_job

SCRIPT = ROOT / "tests" / "scripts" / "lightning_sharded_run.py"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (the [deepspeed] extra)")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # about 20 s alone, more under load

HOOKS = [(0, "on_train_start"), (2, "on_train_batch_end"), (4, "on_train_batch_end"), (4, "on_train_epoch_end")]
HOOKS += [(4, "on_save_checkpoint")]  # Lightning's default ModelCheckpoint, at the epoch's end


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, warm_python: str) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lightning_sharded")
    scenarios = ["fsdp", *(["zero2", "zero2_resync", "zero3"] if HAS_DEEPSPEED else [])]
    paths = [ROOT / "tests", ROOT / "tests" / "scripts"]
    return two_node_job(SCRIPT, out, *scenarios, paths=paths, timeout=500, python=warm_python)


def _fit(runs: dict[str, Any], name: str, engine: str, verdict: str = "diverged") -> list[dict[str, Any]]:
    got = runs.get(name)
    assert got is not None and set(got) == {0, 1}, f"{name}: not every rank reported\n{runs['log']}"
    for out in got.values():
        assert "error" not in out, f"{name}: {out['error']}\n{out.get('traceback')}"
        assert out["engine"] == engine  # the strategy's own wrapper is what the callback was handed
    recs = got[0]["records"]
    assert [(r["step"], r["hook"]) for r in recs] == HOOKS, recs
    # The checkpoint (a directory under both engines) gets its sidecar inside, naming what differed.
    sidecars = got[0]["sidecars"]
    assert [(c["verdict"], c.get("diverged", [])) for c in sidecars] == [(verdict, [n for n, _ in _found(recs[-1])])]
    return recs


def _notes(rec: dict[str, Any]) -> list[str]:
    return rec.get("notes") or []


def _found(rec: dict[str, Any]) -> list[tuple[str, list[int]]]:
    return [(m["name"], m["ranks"]) for m in rec["mismatches"]]


def test_lightning_fsdp1_full_shard_fit_in_sync_with_shards_named_and_buffer_change_found(runs: dict[str, Any]) -> None:
    recs = _fit(runs, "fsdp", "FullyShardedDataParallel")
    healthy, planted = recs[:2], recs[2:]
    assert all(r["in_sync"] and not r["mismatches"] for r in healthy), healthy
    for r in recs:  # Lightning's FSDP1 (use_orig_params): every parameter piece and its Adam state, one owner
        assert r["checked"]["param"] == 0 and r["checked"]["buffer"] == 1 and r["checked"]["optimizer"] > 0, r
        shards = 4 if r["step"] == 0 else 12  # 4 parameter pieces; after a step, their exp_avg and exp_avg_sq too
        assert _notes(r)[0].startswith(f"{shards} tensors have no replica to compare ({shards} FSDP1 shards)"), r
        assert "no parameters were compared" in " ".join(_notes(r)), r
    for r in planted:
        assert not r["in_sync"] and _found(r) == [("scale", [1])], r


@needs_deepspeed
def test_lightning_deepspeed_zero2_fit_in_sync_with_partitions_named_and_param_changes_found_with_master_check(
    runs: dict[str, Any],
) -> None:
    recs = _fit(runs, "zero2", "DeepSpeedEngine")
    healthy, planted = recs[:2], recs[2:]
    assert all(r["in_sync"] and not r["mismatches"] for r in healthy), healthy
    for r in recs:  # module params (all-gathered every step) and the buffer compared; fp32 partitions not
        assert r["checked"]["param"] == 4 and r["checked"]["buffer"] == 1, r
    assert not _notes(recs[0]), recs[0]  # before any step the fp32 partition has no Adam state to audit
    for r in recs[1:]:
        assert _notes(r)[0].startswith("2 tensors have no replica to compare (2 ZeRO optimizer partitions)"), r
    master = "zero.fp32_master_matches_params"  # rank 1's own check: its slice no longer equals its master
    for r in planted:
        assert not r["in_sync"] and _found(r) == [("net.0.weight", [1]), ("net.2.bias", [1]), (master, [1])], r
        assert (
            len(r["hints"]) == 1
            and "edited, loaded or initialised on those ranks after the optimizer step" in r["hints"][0]
        ), r["hints"]  # not an optimizer state loaded on one rank


@needs_deepspeed
def test_lightning_deepspeed_zero2_resync_restores_the_params_and_rank_1s_master_check(runs: dict[str, Any]) -> None:
    recs = _fit(runs, "zero2_resync", "DeepSpeedEngine", verdict="verified")
    resynced = recs[2]
    master = "zero.fp32_master_matches_params"
    assert resynced["action"] == "resynced" and _found(resynced) == [
        ("net.0.weight", [1]),
        ("net.2.bias", [1]),
        (master, [1]),
    ], resynced
    assert "a full audit confirmed the replicas are in sync" in " ".join(_notes(resynced)), resynced
    # Two tensors copied: the master check is drawn from them, restored by their copy, never copied itself.
    assert "resynced 2 tensor(s): 2 from rank 0;" in " ".join(_notes(resynced)), resynced
    # Rank 1's parameters are rank 0's again, so its slice equals its own fp32 master once more.
    assert all(r["in_sync"] and not r["mismatches"] for r in recs[3:]), recs[3:]


@needs_deepspeed
def test_lightning_deepspeed_zero3_fit_counts_partitioned_params_never_checked_and_finds_persistent_change(
    runs: dict[str, Any],
) -> None:
    recs = _fit(runs, "zero3", "DeepSpeedEngine")
    healthy, planted = recs[:2], recs[2:]
    assert all(r["in_sync"] and not r["mismatches"] for r in healthy), healthy
    for r in recs[1:]:  # after a step: the two biases persist (compared), the two weights are placeholders
        assert r["checked"]["param"] == 2 and r["checked"]["buffer"] == 1, r
        assert _notes(r)[0].startswith("2 tensors have no replica to compare (2 ZeRO-3 partitioned parameters)"), r
    # Before any step every parameter is a placeholder: all four named, not one counted as checked.
    assert recs[0]["checked"]["param"] == 0, recs[0]
    assert _notes(recs[0])[0].startswith("4 tensors have no replica to compare (4 ZeRO-3 partitioned parameters)")
    assert "no parameters were compared" in " ".join(_notes(recs[0])), recs[0]
    for r in planted[:2]:
        assert not r["in_sync"] and _found(r) == [("net.2.bias", [1]), ("scale", [1])], r
    assert _found(planted[2]) == [("scale", [1])]  # the bias's edit does not survive DeepSpeed's ZeRO-3 save
    # The sidecar names the two partitioned weights instead of digesting their empty placeholders, so a
    # resume check never calls them matching; the persistent bias and the buffer are digested.
    (sidecar,) = runs["zero3"][0]["sidecars"]
    assert sidecar["partitioned"] == ["state_dict.net.0.weight", "state_dict.net.2.weight"], sidecar
    assert "state_dict.net.2.bias" in sidecar["tensors"] and "state_dict.net.0.weight" not in sidecar["tensors"]
