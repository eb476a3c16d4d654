"""The machine to evict: records name where each odd rank runs; an unstable read is told from a stable one."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from tests.ranks import run_ranks
from weightsync_audit import Auditor
from weightsync_audit.reporting.record import AuditResult


def _diverge(rank: int, world: int, report: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    auditor = Auditor(model)
    healthy = auditor.audit(step=0)
    if rank == 2:
        with torch.no_grad():
            model.bias[0] += 1
    result = auditor.audit(step=1)
    if rank == 0:
        with open(report, "w") as f:
            f.write(json.dumps(healthy.to_dict()) + "\n" + json.dumps(result.to_dict()) + "\n")
    return {"healthy": healthy.to_dict(), "diverged": result.to_dict(), "pid": os.getpid()}


def test_a_divergent_record_names_host_and_process_of_each_odd_rank_and_check_and_show_say_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from weightsync_audit.cli import main

    report = tmp_path / "audit.jsonl"
    out = run_ranks(_diverge, 3, str(report))
    assert "hosts" not in out[0]["healthy"]  # nothing added to a healthy record
    hosts = out[0]["diverged"]["hosts"]
    assert hosts == out[1]["diverged"]["hosts"] == {"2": f"{socket.gethostname()} cpu pid={out[2]['pid']}"}
    assert AuditResult.from_dict(out[0]["diverged"]).hosts == hosts
    assert main(["check", str(report)]) == 1
    assert f"rank 2 runs on {socket.gethostname()} cpu pid={out[2]['pid']}" in capsys.readouterr().out
    assert main(["show", str(report)]) == 0
    assert f"rank 2 (diverged) runs on {socket.gethostname()}" in capsys.readouterr().out
