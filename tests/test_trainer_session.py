"""The framework-free session every adapter drives (open, step aside, cadence, final audit, checkpoints),
and the option helpers' own examples."""

from __future__ import annotations

import doctest
import warnings
from pathlib import Path

import pytest
import torch

from weightsync_audit import AuditOptions, WeightSyncWarning
from weightsync_audit.engine import config, respond
from weightsync_audit.engine.timeline import step_records as step_hyper
from weightsync_audit.integrations.lightning import audit_callback
from weightsync_audit.integrations.session import options, trainer_session
from weightsync_audit.integrations.session.trainer_session import Checkpoint, TrainerSession


@pytest.mark.parametrize("module", [options, trainer_session, audit_callback, config, respond, step_hyper])
def test_the_examples_in_the_docstrings_run(module: object) -> None:
    failed, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert tried and not failed


def test_the_cadence_audits_each_optimizer_step_once_and_the_end_only_when_not_just_audited() -> None:
    session = TrainerSession(AuditOptions(verbose=False), every_n=2)
    assert session.open(world_size=1, is_main=True) and session.active
    session.start(0)
    model = torch.nn.Linear(2, 2)
    due = [s for s in (0, 1, 2, 2, 3, 4, 4) if session.after_step(model, [], s)]
    assert due == [2, 4]  # step 0 started the run; a repeated step (gradient accumulation) is not audited twice
    assert [s for s in (2, 2) if session.after_step(model, [], s, once=False)] == [2, 2]
    assert not session.pending_final(2) and session.pending_final(5) and not session.pending_final(5)
    assert session.audit(model, [], step=5, epoch=0, hook="end", is_main=True).in_sync  # type: ignore[union-attr]
    session.close()
    assert not session.opened and session.audit(model, [], step=6, epoch=0, hook="x", is_main=True) is None


def test_a_disabled_session_says_why_once_and_never_audits() -> None:
    session = TrainerSession(AuditOptions(verbose=False), every_n=1)
    with pytest.warns(WeightSyncWarning, match="sharded"):
        assert not session.open(world_size=2, is_main=True, disabled="sharded: not audited")
    assert session.runner.auditor is None and not session.before_step(None, 0, is_main=True)
    assert session.audit(torch.nn.Linear(2, 2), [], step=1, epoch=0, hook="x", is_main=True) is None
    assert session.summary() == "weightsync audit: not audited (sharded: not audited)"


class _Callback:
    def __init__(self, env_options: dict | None) -> None:
        self.env_options = env_options


def test_the_callback_the_variable_added_steps_aside_for_an_explicit_one_naming_its_dropped_options() -> None:
    explicit, added = _Callback(None), _Callback({"report_path": "a.jsonl"})
    session = TrainerSession(AuditOptions(verbose=False), every_n=1)
    assert not session.step_aside(explicit, [explicit, added], _Callback, is_main=True)  # the explicit one stays
    with pytest.warns(WeightSyncWarning, match="report_path='a.jsonl' are dropped"):
        assert session.step_aside(added, [explicit, added], _Callback, is_main=True)
    assert not session.open(world_size=1, is_main=True) and "is not used" in (session.disabled or "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # alone, the added one audits, and says nothing
        assert not session.step_aside(added, [added], _Callback, is_main=True)
    assert session.open(world_size=1, is_main=True)
    session.close()


def test_a_checkpoint_is_audited_and_its_sidecar_written_through_the_session(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    session = TrainerSession(AuditOptions(verbose=False), every_n=None)
    session.open(world_size=1, is_main=True)
    saved = session.audit(model, [], checkpoint=Checkpoint("saved", path), step=3, epoch=0, hook="save", is_main=True)
    loaded = session.audit(model, [], checkpoint=Checkpoint("loaded", path), step=3, epoch=0, hook="load", is_main=True)
    assert saved is not None and loaded is not None and saved.in_sync and loaded.in_sync
    assert loaded.checkpoint is not None and loaded.checkpoint["status"] == "matching"
    session.close()


def test_two_kinds_of_audit_alternating_each_resynced_are_reported_once_each_then_one_line_per_repeat() -> None:
    from weightsync_audit import AuditResult, Mismatch
    from weightsync_audit.engine.respond import Voice

    def diverged(step: int, *names: str) -> AuditResult:
        found = [Mismatch(n, "optimizer" if "param_groups" in n else "param", [1], [0]) for n in names]
        return AuditResult(in_sync=False, step=step, mismatches=found, action="resynced")

    voice, said = Voice(), []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in range(1, 5):  # the lr differs before each step and after it, resynced each time
            voice.speak(diverged(step, "param_groups.0.lr"), verbose=True, print_fn=said.append, kind="grads")
            voice.speak(diverged(step, "param_groups.0.lr", "w"), verbose=True, print_fn=said.append)
    reports = [s for s in said if isinstance(s, AuditResult)]
    again = [s for s in said if isinstance(s, str)]
    assert [r.diverged_names for r in reports] == [["param_groups.0.lr"], ["param_groups.0.lr", "w"]]
    assert again == [f"weightsync audit: step {s}: resynced again, {s} times, same cause" for s in (2, 2, 3, 3, 4, 4)]
    assert len([w for w in warned if "the cause persists" in str(w.message)]) == 2  # once per kind
