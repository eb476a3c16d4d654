"""The report record of the contract (shared/design/contract.md), as the tests' reference example."""

from __future__ import annotations

from typing import Any

CONTRACT_EXAMPLE: dict[str, Any] = {
    "schema": "weightsync-audit/1",
    "time": "2026-12-02T16:40:00Z",
    "step": 49,
    "epoch": 3,
    "hook": "on_train_batch_end",
    "world_size": 2,
    "in_sync": False,
    "last_in_sync_step": 48,
    "checked": {"param": 4, "buffer": 0, "optimizer": 2, "grad": 0},
    "mismatches": [
        {
            "name": "backbone.weight",
            "kind": "param",
            "ranks": [1],
            "reference_ranks": [0],
            "shape": [16, 32],
            "dtype": "float32",
            "max_abs_diff": 0.0031,
            "detail": None,
        }
    ],
    "hints": ["backbone.weight, backbone.bias require grad, but DistributedDataParallel does not all-reduce ..."],
    "action": "warned",
    "duration_ms": 1.7,
}
