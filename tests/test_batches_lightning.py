"""``check_batches`` on the Lightning callback, in a real ``Trainer`` on 2 ranks (ddp_fork): a loader without
Lightning's distributed sampler hands every rank the same batches (the classic data-parallel bug), and the
records name it at every audited step; with the sampler (Lightning's default) nothing is said. The truth is
the batches each rank's ``training_step`` received, compared here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning_helpers import SmallModel, fit, records

from weightsync_audit import WeightSyncAudit


class SeenBatches(SmallModel):
    """:class:`SmallModel` that writes the batches it trained on (one file per rank)."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.seen: list[list[float]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.flatten()[:4].tolist())
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        (self.out / f"seen{self.global_rank}.json").write_text(json.dumps(self.seen))


@pytest.mark.parametrize("sampler", [False, True], ids=["same-batches", "distributed-sampler"])
def test_the_lightning_callback_names_ranks_that_trained_on_identical_batches(tmp_path: Path, sampler: bool) -> None:
    report = tmp_path / "r.jsonl"
    audit = WeightSyncAudit(every_n_train_steps=2, verbose=False, report_path=str(report), check_batches=True)
    fit(tmp_path, SeenBatches(tmp_path), [audit], max_epochs=1, use_distributed_sampler=sampler)
    seen = [json.loads((tmp_path / f"seen{r}.json").read_text()) for r in (0, 1)]
    steps = [r for r in records(report) if r["hook"] == "on_train_batch_end"]
    assert steps and all(r["in_sync"] for r in steps)
    for r in steps:  # the truth: the batch of the audited step (the last one trained before it), rank 0 vs 1
        same = seen[0][r["step"] - 1] == seen[1][r["step"] - 1]
        said = [n for n in r.get("notes", []) if f"identical batches at step {r['step']}" in n]
        assert bool(said) is same, (r["step"], r.get("notes"))
    assert any(a == b for a, b in zip(*seen)) is not sampler


def test_the_hugging_face_callback_refuses_check_batches_and_says_why() -> None:
    from weightsync_audit.transformers import WeightSyncAuditCallback

    with pytest.raises(TypeError, match="check_batches=True: check_batches is LoopAudit's and the Lightning"):
        WeightSyncAuditCallback(check_batches=True)
