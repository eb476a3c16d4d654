"""What an audit at every committed step costs a torchft training loop, against the same loop unaudited.

    python benchmarks/bench_torchft.py                  # 2 replica groups, the two models below
    python benchmarks/bench_torchft.py --steps 60

Each replica group is its own process (tests/torchft_jobs.py: a real lighthouse, real Managers, torchft's
DDP and Adam, batches of 8). The same job runs twice in a row: unaudited, then audited at every committed
step (``every_n_steps=1``). ``step ms`` is the median wall time of a loop iteration (forward, backward,
torchft's all-reduce, the optimizer step and, audited, the audit in its pre-hook) from step 3 on;
``audit ms`` the median ``duration_ms`` of the records (the roll call in the quorum's store and the audit
over the channel, reused while the quorum's members stay the same); ``audit / step`` that over the
unaudited step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness import machine, table
from torchft_jobs import Replica, run_job

MODELS = {"tiny (450 params)": {"width": 64}, "4 x Linear(1024,1024)": {"square": 1024}}


def _step_ms(res: dict[Any, Any]) -> float:
    return statistics.median(t for r in res.values() for t in r["step_s"][3:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    rows: list[list[Any]] = []
    for name, shape in MODELS.items():
        job = dict(steps=args.steps, every=1, timeout_s=30.0, deadline_s=600.0, **shape)
        bare = _step_ms(run_job([Replica(0), Replica(1)], audit=False, **job))
        res = run_job([Replica(0), Replica(1)], **job)
        audits = [x["duration_ms"] for r in res.values() for x in r["records"] if x["in_sync"] and x["step"] >= 3]
        audit_ms = statistics.median(audits)
        rows.append([name, f"{bare:.1f}", f"{_step_ms(res):.1f}", str(len(audits)), f"{audit_ms:.2f}",
                     f"{100 * audit_ms / bare:.1f}%"])  # fmt: skip
    print(machine())
    print("2 replica groups of 1 process; Adam; an audit at every committed step; medians from step 3 on")
    print(table(["model", "step ms", "audited step ms", "audits", "audit ms", "audit / step"], rows))


if __name__ == "__main__":
    main()
