"""Each callback keeps its framework's option names, and a name from the other framework (or a typo) is
answered with the right one; the HF callback's figures reach the report_to integrations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hf_setup import tiny_trainer
from torch import nn

from weightsync_audit import LoopAudit


def _lightning_classes() -> list[type]:
    from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit

    classes: list[type] = [WeightSyncAudit]
    try:
        from weightsync_audit.lightning.lightning_pytorch import WeightSyncAudit as LWeightSyncAudit
    except ImportError:  # the `lightning` package is not installed here
        return classes
    return [*classes, LWeightSyncAudit]


def test_hf_callback_given_lightnings_cadence_name_suggests_its_own() -> None:
    from weightsync_audit.transformers import WeightSyncAuditCallback

    with pytest.raises(TypeError, match=r"every_n_train_steps=50: did you mean every_n_steps=50\? .*Lightning"):
        WeightSyncAuditCallback(every_n_train_steps=50)


@pytest.mark.parametrize("cls", _lightning_classes())
def test_lightning_callback_given_the_hf_cadence_name_suggests_its_own(cls: type) -> None:
    with pytest.raises(TypeError, match=r"every_n_steps=50: did you mean every_n_train_steps=50\? .*Hugging Face"):
        cls(every_n_steps=50)
    with pytest.raises(TypeError, match=r"report_pth='a.jsonl': did you mean report_path='a.jsonl'\?"):
        cls(report_pth="a.jsonl")


def test_loop_audit_keeps_every_n_steps_and_answers_a_typo() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"did you mean every_n_steps=5\?"):
        LoopAudit(model, every_n_train_steps=5)
    with pytest.raises(TypeError, match=r"on_mismtach='raise': did you mean on_mismatch='raise'\?"):
        LoopAudit(model, on_mismtach="raise")
    with pytest.raises(TypeError, match="the options are"):
        LoopAudit(model, zzz=1)


def test_hf_metrics_reach_a_logging_integration_listed_before_the_callback(tmp_path: Path) -> None:
    from transformers import TrainerCallback

    from weightsync_audit.transformers import WeightSyncAuditCallback

    class Reporter(TrainerCallback):
        """Stands in for TensorBoard/W&B: the Trainer lists report_to integrations before user callbacks."""

        def __init__(self) -> None:
            self.seen: list[dict[str, Any]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            self.seen.append(dict(logs or {}))

    reporter = Reporter()
    audit = WeightSyncAuditCallback(every_n_steps=2, verbose=False)
    trainer = tiny_trainer(
        tmp_path, [reporter, audit], rows=16, model_seed=0, max_steps=4, per_device_train_batch_size=4,
        logging_steps=2, seed=0,
    )  # fmt: skip
    trainer.train()
    logged = [s for s in reporter.seen if "loss" in s]
    assert logged and all(s.get("weightsync/in_sync") == 1.0 for s in logged), reporter.seen
    lead = trainer.callback_handler.callbacks[0]  # ahead of every integration, for on_log only
    assert type(lead).__name__ == "_LogLead" and lead.owner is audit
    assert trainer.callback_handler.callbacks[1:].index(audit) > trainer.callback_handler.callbacks[1:].index(reporter)
