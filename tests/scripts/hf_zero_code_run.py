"""A Hugging Face training script that says nothing about the audit (tests/test_activation_hf_zero_code.py).

``python hf_zero_code_run.py OUT [explicit]``, alone or under ``torchrun`` (gloo, CPU). A first Trainer is
built with no callbacks: the only audit is the one ``WEIGHTSYNC_AUDIT`` adds; each rank writes the names of
its callbacks to ``OUT/callbacks.rank<r>.json``. With ``explicit``, a second Trainer in the same process is
given the script's own ``WeightSyncAuditCallback`` (report ``OUT/own.jsonl``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared Trainer set-up
from hf_setup import go_offline, tiny_trainer

go_offline()


def train(out: str, callbacks: list) -> list[str]:
    """Four steps of a tiny model; the names of the Trainer's callbacks."""
    trainer = tiny_trainer(
        os.path.join(out, "trainer"), callbacks, rows=8, gloo="RANK" in os.environ, max_steps=4,
        per_device_train_batch_size=2,
    )  # fmt: skip
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    trainer.train()
    return names


def main(out: str, explicit: bool) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    names = train(out, [])
    with open(os.path.join(out, f"callbacks.rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(names, f)
    if explicit:
        from weightsync_audit.transformers import WeightSyncAuditCallback

        train(
            out, [WeightSyncAuditCallback(every_n_steps=2, report_path=os.path.join(out, "own.jsonl"), verbose=False)]
        )


if __name__ == "__main__":
    main(sys.argv[1], explicit=sys.argv[2:] == ["explicit"])
