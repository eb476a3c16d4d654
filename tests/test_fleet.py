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


def _flipping(rank: int, world: int) -> dict:
    """Rank 1 has a thread writing a new value into one weight continuously: its bytes never hold still."""
    import threading
    import time

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    auditor = Auditor(model)
    assert auditor.audit(step=0).in_sync
    stop = threading.Event()

    def flip() -> None:
        # Never asleep: whenever the audit waits on the exchange between its two reads, this thread is ready to
        # run (a 0.2 ms sleep here once missed the whole window on a starved host, and the read was "stable").
        n = 0
        while not stop.is_set():
            n += 1
            with torch.no_grad():
                model[0].weight[0, 0] = float(n)
            time.sleep(0)

    if rank == 1:
        with torch.no_grad():
            model[1].bias[0] += 1  # a plain, stable difference beside the unstable one
        thread = threading.Thread(target=flip, daemon=True)
        thread.start()
        time.sleep(0.01)
    result = auditor.audit(step=1)
    stop.set()
    return result.to_dict()


def test_a_tensor_whose_bytes_change_between_two_reads_is_unstable_and_a_plain_difference_stable() -> None:
    out = run_ranks(_flipping, 2)
    assert out[0]["mismatches"] == out[1]["mismatches"] and out[0]["hints"] == out[1]["hints"]
    by_name = {m["name"]: m for m in out[0]["mismatches"]}
    assert by_name["0.weight"]["stability"] == "unstable" and by_name["0.weight"]["ranks"] == [1]
    assert by_name["1.bias"]["stability"] == "stable"
    [hint] = [h for h in out[0]["hints"] if "unstable read" in h]
    assert "0.weight" in hint and "1.bias" not in hint and f"rank 1 on {socket.gethostname()}" in hint


def _diverges_twice(rank: int, world: int) -> list[dict]:
    from weightsync_audit import AuditOptions
    from weightsync_audit.integrations.session.runner import AuditRunner

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    runner = AuditRunner(AuditOptions(on_mismatch="resync", verbose=False))
    runner.open(world_size=world, is_main=rank == 0)
    out = []
    for step in (1, 2):
        if rank == 1:
            with torch.no_grad():
                model.weight[0, 0] += 0.5  # the same machine corrupts the same weight again
        result = runner.run(model, [], step=step, epoch=0, hook="test", is_main=rank == 0)
        assert result is not None
        out.append(result.to_dict())
    runner.close()
    return out


def test_a_divergence_back_after_a_resync_on_a_tie_says_the_cause_persists_and_names_no_machine() -> None:
    # Two ranks and no attribution: the vote is a tie, so nothing says which machine it is. The machine is
    # named, to evict, only on evidence about it (tests/test_composition.py, with attribution).
    first, second = run_ranks(_diverges_twice, 2)[0]
    assert first["action"] == second["action"] == "resynced"
    assert not any("diverged again" in h for h in first["hints"])
    [hint] = [h for h in second["hints"] if "diverged again" in h]
    assert "the replicas diverged again after a resync at step 1: the cause persists" in hint
    assert "no machine is named" in hint and "persistent fault" not in hint and "evict it" not in hint


def _frozen_on_rank_1(rank: int, world: int) -> list[str]:
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if rank == 1:
        model.requires_grad_(False)  # frozen by mistake on this rank only
    opt = torch.optim.SGD(
        [p for p in model.parameters()] if rank == 0 else [torch.zeros(1, requires_grad=True)], lr=0.1
    )
    auditor = Auditor(model, opt, pinpoint=True)
    said = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 4):
            if rank == 0:
                model(torch.ones(1, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            auditor.record_step(step)
        said = [str(w.message) for w in caught if "changed over optimizer step" in str(w.message)]
    return said


def test_a_rank_whose_weights_did_not_change_over_a_step_with_lr_above_zero_is_warned_naming_the_step() -> None:
    said = run_ranks(_frozen_on_rank_1, 2)
    assert said[0] == []
    assert len(said[1]) == 1 and "on rank 1 nothing audited changed over optimizer step 2 although lr=0.1" in said[1][0]
