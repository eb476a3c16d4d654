"""Mesh-aware audits: FSDP2, HSDP and FSDP2 + tensor parallel compared shard by shard among peers.

Each scenario is one real 4-rank (or 2-rank) gloo group; every rank returns its record, and the
records must be the same on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from mesh_models import dp_tp_model, fsdp_model, hsdp_model, train
from ranks import run_ranks

from weightsync_audit import audit, resync

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
    assert any("3 sharded tensors have no replica" in n or "9 sharded tensors" in n for n in clean["notes"])

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
