"""The evict hand-off from a record (no ranks needed: it is local), with the truth planted in the record."""

from __future__ import annotations

import json
from pathlib import Path

from weightsync_audit.integrations.evict import EVICT_FILE_ENV, SEGMENT_DIR_ENV, read_evict, write_evict
from weightsync_audit.reporting.record import AuditResult, Mismatch


def _record(stability: str | None, action: str = "warned") -> AuditResult:
    m = Mismatch("net.0.weight", "param", [3], [0, 1, 2], [4], "float32", None, "")
    m.stability = stability
    hosts = {"3": "node-9 local_rank=3 cuda:3 GPU-abc pci=0000:1b:00.0"}
    return AuditResult(in_sync=False, step=40, epoch=0, world_size=4, mismatches=[m], action=action, hosts=hosts)


def test_an_unstable_rank_under_warn_is_handed_on_as_hardware_suspect(tmp_path: Path) -> None:
    env = {EVICT_FILE_ENV: str(tmp_path / "evict.json"), SEGMENT_DIR_ENV: str(tmp_path), "SLURM_JOB_ID": "77"}
    assert write_evict(_record("unstable"), rank=0, is_main=True, exit_code=None, env=env) == [tmp_path / "evict.json"]
    doc = read_evict(tmp_path / "evict.json")
    assert doc is not None and (doc["reason"], doc["exit_code"], doc["step"]) == ("hardware-suspect", None, 40)
    assert [(h["rank"], h["host"]) for h in doc["hosts"]] == [(3, "node-9")]
    # the rank named writes its own segment's health-check file, non-empty: NVRx leaves that segment out
    written = write_evict(_record("unstable"), rank=3, is_main=False, exit_code=None, env=env)
    assert written == [tmp_path / "segment_health_check.77.77"] and written[0].read_text().strip()


def test_a_stable_divergence_under_warn_names_no_host_and_writes_nothing(tmp_path: Path) -> None:
    env = {EVICT_FILE_ENV: str(tmp_path / "evict.json")}
    assert write_evict(_record("stable"), rank=0, is_main=True, exit_code=None, env=env) == []
    assert not (tmp_path / "evict.json").exists()


def test_an_exit_code_names_the_odd_rank_and_another_launch_does_not_read_it(tmp_path: Path) -> None:
    env = {EVICT_FILE_ENV: str(tmp_path / "evict.json"), "WEIGHTSYNC_LAUNCH_ID": "abc"}
    write_evict(_record("stable", "raised"), rank=0, is_main=True, exit_code=17, env=env)
    doc = json.loads((tmp_path / "evict.json").read_text())
    assert (doc["reason"], doc["exit_code"], [h["rank"] for h in doc["hosts"]]) == ("diverged", 17, [3])
    assert read_evict(tmp_path / "evict.json", "abc") is not None
    assert read_evict(tmp_path / "evict.json", "another launch") is None
