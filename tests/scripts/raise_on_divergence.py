"""Run by tests through Lightning's subprocess `ddp` launcher (the bug report's own launcher).

A head weight is nudged on rank 1 at step 3; ``WeightSyncAudit(on_mismatch="raise")`` must end every
rank with ``WeightDivergenceError`` at that step. Usage: python raise_on_divergence.py OUT_DIR
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_helpers import Perturb, SmallModel, fit

from weightsync_audit.lightning.pytorch_lightning import WeightSyncAudit


def nudge(trainer, module):  # type: ignore[no-untyped-def]
    module.net[-1].weight[0, 0] += 1e-3


if __name__ == "__main__":
    out = Path(sys.argv[1])
    fit(
        out,
        SmallModel(),
        [
            Perturb(1, 3, nudge),
            WeightSyncAudit(every_n_train_steps=1, on_mismatch="raise", report_path=str(out / "audit.jsonl")),
        ],
        strategy="ddp",
        max_epochs=3,
    )
