"""The Hugging Face Trainer with ``deepspeed=`` ZeRO-2 and ZeRO-3 on 2 CPU gloo ranks, audited end to end, and
launched as ``accelerate launch --use_deepspeed`` would (``args.deepspeed`` unset, the plugin in Accelerate's
state only).

Launched like tests/test_integrations.py (``torchrun`` twice, two one-process nodes); the script is
tests/scripts/hf_deepspeed_run.py. Healthy runs stay in sync with the partitions named in the note and no
placeholder counted; a change planted on rank 1 in a replicated parameter is found by name and rank.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from torchrun import OFFLINE, ROOT, two_node_job

SCRIPT = ROOT / "tests" / "scripts" / "hf_deepspeed_run.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, warm_python: str) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hf_deepspeed")
    paths = [ROOT / "tests" / "scripts"]
    return two_node_job(SCRIPT, out, paths=paths, env=OFFLINE, timeout=800, python=warm_python)


def _records(runs: dict[str, Any], name: str) -> list[dict[str, Any]]:
    got = runs.get(name)
    assert got is not None and set(got) == {0, 1}, f"{name}: not every rank reported\n{runs['log']}"
    for out in got.values():
        assert "error" not in out, f"{name}: {out['error']}\n{out.get('traceback')}"
    return got[0]["records"]


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_trainer_deepspeed_healthy_run_in_sync_with_partitions_named_never_counted(
    runs: dict[str, Any], stage: int
) -> None:
    recs = _records(runs, f"zero{stage}_0")
    assert [r["step"] for r in recs] == [0, 2, 4] and all(r["in_sync"] for r in recs), recs
    last = recs[-1]
    what = "ZeRO optimizer partitions" if stage == 2 else "ZeRO-3 partitioned parameters"
    assert what in " ".join(last["notes"]), last["notes"]
    assert last["checked"]["param"] == (28 if stage == 2 else 16)  # ZeRO-3: the 12 2-D weights are placeholders


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_trainer_deepspeed_change_on_rank_1_found_by_name_and_rank(runs: dict[str, Any], stage: int) -> None:
    last = _records(runs, f"zero{stage}_1")[-1]
    assert [(m["name"], m["ranks"]) for m in last["mismatches"]] == [("transformer.h.1.ln_1.weight", [1])], last


def test_hf_trainer_deepspeed_compares_buffers_without_blaming_ddp_broadcast(runs: dict[str, Any]) -> None:
    last = _records(runs, "zero2_batchnorm")[-1]
    assert last["checked"]["buffer"] == 3, last  # DeepSpeed broadcasts buffers at initialisation only
    assert not any("broadcast" in n for n in last.get("notes", [])), last["notes"]
    # Per-rank batches, per-rank BatchNorm statistics: a real divergence under DeepSpeed, reported.
    assert {m["name"] for m in last["mismatches"]} >= {"body.1.running_mean", "body.1.running_var"}, last


def test_hf_trainer_fsdp_on_cpu_trains_plain_ddp_and_is_audited_as_ddp(runs: dict[str, Any]) -> None:
    recs = _records(runs, "fsdp_on_cpu")
    assert recs and all(r["in_sync"] and r["checked"]["param"] == 28 for r in recs), recs


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_trainer_via_accelerate_deepspeed_config_file_audited_as_deepspeed(runs: dict[str, Any], stage: int) -> None:
    recs = _records(runs, f"accelerate_zero{stage}")
    out = runs[f"accelerate_zero{stage}"][0]
    # As `accelerate launch --use_deepspeed --deepspeed_config_file` leaves it: args.deepspeed unset.
    assert out["args_deepspeed"] is None and out["zero_stage"] == stage and out["engine_of"] == "deepspeed", out
    assert [r["step"] for r in recs] == [0, 2, 4] and all(r["in_sync"] for r in recs[:2]), recs
    what = "ZeRO optimizer partitions" if stage == 2 else "ZeRO-3 partitioned parameters"
    assert all(what in " ".join(r["notes"]) for r in recs[1:]), [r.get("notes") for r in recs]
    assert [r["checked"]["param"] for r in recs] == ([28] * 3 if stage == 2 else [0, 16, 16]), recs
    if stage == 3:  # before the first forward every parameter is a placeholder: said, never counted as checked
        assert "no parameters were compared" in " ".join(recs[0]["notes"]), recs[0]["notes"]
    assert [(m["name"], m["ranks"]) for m in recs[-1]["mismatches"]] == [("transformer.h.1.ln_1.weight", [1])]


def test_hf_trainer_via_accelerate_zero_stage_compares_buffers_as_deepspeed_does(runs: dict[str, Any]) -> None:
    last = _records(runs, "accelerate_zero2_batchnorm")[-1]
    assert last["checked"]["buffer"] == 3, last  # read from Accelerate's state: DeepSpeed, not DDP
    assert not any("broadcast" in n for n in last.get("notes", [])), last["notes"]
    assert {m["name"] for m in last["mismatches"]} >= {"body.1.running_mean", "body.1.running_var"}, last
    assert runs["accelerate_zero2_batchnorm"][0]["engine_of"] == "deepspeed"
