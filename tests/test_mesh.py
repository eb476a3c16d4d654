"""Mesh-aware audits: FSDP2, HSDP and FSDP2 + tensor parallel compared shard by shard among peers.

Each scenario is one real 4-rank (or 2-rank) gloo group; every rank returns its record, and the
records must be the same on every rank.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning_helpers import records
from mesh_models import dp_tp_model, fsdp_model, hsdp_model, train
from ranks import run_ranks
from rich.console import Console

from weightsync_audit import AuditResult, Mismatch, audit, resync
from weightsync_audit.cli import main
from weightsync_audit.engine.agreement.consensus import compare_manifests
from weightsync_audit.errors import ReportFormatError
from weightsync_audit.integrations.lightning.audit_callback import sharded_strategy_reason
from weightsync_audit.reporting.jsonl import ReportWriter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _same_everywhere(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The records without time and duration must be identical on every rank; return rank 0's."""
    stripped = [{k: v for k, v in r.items() if k not in ("time", "duration_ms")} for r in records]
    assert all(s == stripped[0] for s in stripped), stripped
    return stripped[0]


def _dp_tp(rank: int, world: int) -> dict[str, Any]:
    model, _ = dp_tp_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dp = rank // 2  # TP peers (same dp coordinate) see the same batches
    train(model, opt, 3, seed=dp)
    clean = audit(model, opt, step=3).to_dict()
    # pytorch#160169: each TP rank adds its own 1e-5 noise to the DP-only gradients (ln, dp1).
    train(model, opt, 5, seed=dp, noise=1e-5, noisy=("ln", "dp1"), noise_seed=rank)
    drift = audit(model, opt, step=8).to_dict()
    return {"clean": clean, "drift": drift}


def test_dp_tp_mesh_compares_dp_only_and_tp_replicated_params_across_tp_peers_and_finds_160169_drift() -> None:
    out = run_ranks(_dp_tp, 4, timeout=120)
    clean = _same_everywhere([o["clean"] for o in out])
    assert clean["in_sync"], clean
    # ln.weight/bias, dp1.weight/bias (DP-only) and tp_row.bias (replicated over tp) have TP peers;
    # tp_col.* and tp_row.weight are sharded over both dims: no replica anywhere.
    assert clean["checked"]["param"] == 5
    assert any(n.startswith("9 sharded tensors have no replica to compare") for n in clean["notes"])

    drift = _same_everywhere([o["drift"] for o in out])
    assert not drift["in_sync"]
    params = {(m["name"], tuple(m["shard"].items())): m for m in drift["mismatches"] if m["kind"] == "param"}
    names = {n for n, _ in params}
    assert names == {"ln.weight", "ln.bias", "dp1.weight", "dp1.bias"}, names
    # Each dp shard drifts between its two TP peers; the tie goes to the lower rank.
    assert params[("ln.weight", (("dp", 0),))]["ranks"] == [1]
    assert params[("ln.weight", (("dp", 0),))]["reference_ranks"] == [0]
    assert params[("ln.weight", (("dp", 1),))]["ranks"] == [3]
    assert all(0 < m["max_abs_diff"] < 1e-3 for m in params.values())
    assert not any(m["name"].startswith("tp_") for m in drift["mismatches"])
    print("\n".join(str(m) for m in drift["mismatches"] if m["kind"] == "param"))


def _hsdp(rank: int, world: int) -> dict[str, Any]:
    model, _ = hsdp_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 2, seed=0)  # the same batches everywhere: buffers agree too
    clean = audit(model, opt, step=2).to_dict()
    with torch.no_grad():
        if rank == 3:
            model.fc1.weight.to_local().add_(1e-3)
            opt.state[model.fc1.weight]["exp_avg"].to_local().add_(1.0)
        if rank == 1:
            model.bn.running_mean.add_(0.5)
        if rank == 2:
            opt.param_groups[0]["lr"] = 0.5
    planted = audit(model, opt, step=3).to_dict()
    resync(model, opt, src=0)
    after = audit(model, opt, step=4).to_dict()
    # Bit-identical to its peer: rank 3 holds the same fc1.weight shard as rank 1.
    mine = model.fc1.weight.to_local().clone()
    held = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(held, mine)
    return {"clean": clean, "planted": planted, "after": after, "same_as_peer": torch.equal(held[1], held[3])}


def test_hsdp_world_wide_audit_finds_one_rank_shard_exp_avg_buffer_and_lr_then_resync_repairs_the_shard() -> None:
    out = run_ranks(_hsdp, 4, timeout=120)
    clean = _same_everywhere([o["clean"] for o in out])
    assert clean["in_sync"] and clean["checked"]["param"] == 6, clean
    planted = _same_everywhere([o["planted"] for o in out])
    got = {m["name"]: m for m in planted["mismatches"]}
    assert set(got) == {"fc1.weight", "fc1.weight.exp_avg", "bn.running_mean", "param_groups.0.lr"}, got
    # replicate x shard = [[0, 1], [2, 3]]: rank 3 holds shard 1, as rank 1 does.
    for name in ("fc1.weight", "fc1.weight.exp_avg"):
        assert got[name]["ranks"] == [3] and got[name]["reference_ranks"] == [1]
        assert got[name]["shard"] == {"shard": 1}
    assert got["bn.running_mean"]["ranks"] == [1] and "shard" not in got["bn.running_mean"]
    assert got["param_groups.0.lr"]["ranks"] == [2]
    assert any("FSDP2" in h and "buffers" in h for h in planted["hints"])
    assert any(h.startswith("Shards of fc1.weight differ") for h in planted["hints"])
    after = _same_everywhere([o["after"] for o in out])
    assert after["in_sync"], after
    assert all(o["same_as_peer"] for o in out)


def _pure_fsdp(rank: int, world: int) -> dict[str, Any]:
    model = fsdp_model(world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 2, seed=rank)  # each rank its own batches: BatchNorm statistics differ per rank
    return audit(model, opt, step=2).to_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_pure_fsdp2_gives_no_false_alarm_on_params_and_reports_per_rank_batchnorm_stats(world: int) -> None:
    rec = _same_everywhere(run_ranks(_pure_fsdp, world, timeout=120))
    kinds = {m["kind"] for m in rec["mismatches"]}
    assert kinds == {"buffer"}, rec["mismatches"]
    assert {m["name"] for m in rec["mismatches"]} == {"bn.running_mean", "bn.running_var"}
    assert rec["mismatches"][0]["ranks"] == list(range(1, world))
    assert rec["checked"]["param"] == 0
    # 6 params and their exp_avg, exp_avg_sq: 18 shards with no replica, said once.
    assert "18 sharded tensors have no replica to compare" in " ".join(rec["notes"])
    assert any(n.startswith("no parameters were compared") for n in rec["notes"])
    assert not any("still agree" in h for h in rec["hints"])
    assert any("FSDP2" in h for h in rec["hints"])


def _model_parallel_run(python: str, tmp_path: Path, mode: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    script = Path(__file__).parent / "scripts" / "model_parallel_run.py"
    proc = subprocess.run([python, str(script), str(tmp_path), mode], capture_output=True, text=True, timeout=240)
    ends = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    return records(tmp_path / "audit.jsonl"), [*ends, {"rc": proc.returncode, "stderr": proc.stderr[-3000:]}]


def test_model_parallel_strategy_fsdp2_is_audited_in_sync_and_a_planted_lr_is_reported(
    fsdp2_strategy_run: dict[str, Any],
) -> None:
    # The session's one FSDP2 run through the strategy (tests/conftest.py; with attribution, which
    # tests/test_mesh_attribution.py judges).
    recs, ends = fsdp2_strategy_run["records"], fsdp2_strategy_run["ends"]
    assert ends[2]["rc"] == 0 and ends[0]["ended"] == ends[1]["ended"] == "ok", ends
    steps = {r["step"]: r for r in recs if r["hook"] == "on_train_batch_end"}
    assert steps[1]["in_sync"] and steps[2]["in_sync"]
    assert "18 sharded tensors have no replica to compare" in " ".join(steps[2]["notes"])
    assert [(m["name"], m["ranks"]) for m in steps[3]["mismatches"]] == [("param_groups.0.lr", [1])]
    assert steps[3]["action"] == "warned"
    # No parameter had a replica, so no hint may claim the parameters still agree.
    assert not any("still agree" in h for h in steps[3]["hints"])
    assert any("no parameter could be compared" in h for h in steps[3]["hints"])


def test_model_parallel_strategy_tp_is_audited_and_raise_raises_on_every_rank(tmp_path: Path, warm_python: str) -> None:
    recs, ends = _model_parallel_run(warm_python, tmp_path, "tp")
    assert ends[2]["rc"] != 0
    assert [e["ended"] for e in ends[:2]] == ["WeightDivergenceError"] * 2, ends
    assert ends[0]["step"] == ends[1]["step"] == 3
    steps = {r["step"]: r for r in recs if r["hook"] == "on_train_batch_end"}
    assert steps[1]["in_sync"] and steps[2]["in_sync"] and steps[2]["checked"]["param"] == 3
    # The RowwiseParallel bias is Replicate on the tp mesh: compared on both ranks, and no shard to name.
    assert [(m["name"], m["ranks"], m.get("shard")) for m in steps[3]["mismatches"]] == [("down.bias", [1], None)]
    assert steps[3]["action"] == "raised"


def test_only_strategies_without_dtensors_are_refused() -> None:
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
    from lightning.pytorch.strategies import ModelParallelStrategy as TrainerModelParallel
    from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy

    assert sharded_strategy_reason(FabricModelParallel(lambda m, _: m)) is None
    assert sharded_strategy_reason(TrainerModelParallel()) is None
    assert sharded_strategy_reason(DDPStrategy()) is None
    assert sharded_strategy_reason(FSDPStrategy()) is None  # FSDP1: audited through its replica adapter


def test_shard_is_in_the_record_table_check_and_show_and_old_records_still_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    m = Mismatch("ln.weight", "param", [1], [0], [8], "float32", 3.3e-6, None, {"dp": 0})
    notes = ["18 sharded tensors have no replica to compare: ...", "no parameters were compared: ..."]
    r = AuditResult(in_sync=False, step=5, world_size=4, mismatches=[m], notes=notes)
    d = r.to_dict()
    assert d["mismatches"][0]["shard"] == {"dp": 0}
    assert AuditResult.from_dict(d).mismatches[0].shard == {"dp": 0}
    plain = AuditResult(in_sync=False, step=5, mismatches=[Mismatch("w", "param", [1], [0])]).to_dict()
    assert "shard" not in plain["mismatches"][0] and AuditResult.from_dict(plain).mismatches[0].shard is None
    with pytest.raises(ReportFormatError, match="shard"):
        Mismatch.from_dict({**d["mismatches"][0], "shard": {"dp": "zero"}})
    console = Console(width=200, record=True)
    console.print(r)
    assert "weight [shard dp=0]" in console.export_text()
    report = tmp_path / "audit.jsonl"
    with ReportWriter(report) as w:
        w.write(r)
    assert main(["check", str(report)]) == 1
    out = capsys.readouterr().out
    assert "ln.weight (param, shard dp=0" in out
    assert "note: no parameters were compared" in out and "18 sharded tensors have no replica" in out
    assert main(["show", str(report)]) == 0
    assert "weight@dp=0" in capsys.readouterr().out


def test_a_structure_difference_does_not_hide_a_shard_that_differs_within_its_peer_set() -> None:
    # Rows [kind, name, dtype, global shape, digest, layout, peer key]; ranks 0, 2 hold one shard, 1, 3 the other.
    lay = "(dp):(Shard(dim=0),)"
    rows = [
        [["param", "w", "float32", [8], 5, lay, 10], ["buffer", "b", "float32", [2], 1]],
        [["param", "w", "float32", [8], 6, lay, 14], ["buffer", "b", "float32", [2], 1]],
        [["param", "w", "float32", [8], 5, lay, 10], ["buffer", "b", "float32", [2], 1]],
        [["param", "w", "float32", [8], 7, lay, 14]],
    ]
    structure, values = compare_manifests(rows)
    assert [(d.name, d.ranks) for d in structure] == [("b", (3,))]
    assert [(d.uid, d.ranks, d.reference_ranks, d.peer_set) for d in values] == [("param:w", (3,), (1,), (1, 3))]
