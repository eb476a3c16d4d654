"""A layer unfrozen mid-run under the Hugging Face Trainer's own DDP wrap, on 2 real gloo ranks.

The runs are tests/scripts/hf_unfreeze_run.py's, two scenarios of the Trainer launch that
tests/test_integrations.py judges too (tests/scripts/trainers_run.py: ``torchrun`` twice, two one-process
nodes; the ``trainer_runs`` fixture of tests/conftest.py). The callback reads the wrapper the Trainer trains through, so the change
is warned about before the step, the proven hint names it, and the fix it offers keeps replicas in sync.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


from weightsync_audit.integrations.hf.callback import TRAINER_FIX

PROVEN = "body.weight, body.bias require grad, but DistributedDataParallel does not all-reduce"


@pytest.fixture(scope="module")
def runs(trainer_runs: dict[str, Any]) -> dict[str, Any]:
    # The two runs are scenarios of the Trainer launch tests/test_integrations.py judges too (one launch).
    return {
        "log": trainer_runs["log"],
        "bug": trainer_runs.get("hf_unfreeze_bug"),
        "fix": trainer_runs.get("hf_unfreeze_fix"),
    }


def _got(runs: dict[str, Any], name: str) -> dict[int, Any]:
    got = runs.get(name)
    assert got is not None and set(got) == {0, 1}, f"{name}: not every rank reported\n{runs['log']}"
    for out in got.values():
        assert "error" not in out, f"{name}: {out['error']}\n{out.get('traceback')}"
    return got


def test_hf_unfreeze_after_the_trainers_ddp_wrap_is_warned_before_the_step_and_proven_with_the_trainer_fix(
    runs: dict[str, Any],
) -> None:
    got = _got(runs, "bug")
    assert got[0]["wrapper"] == "DistributedDataParallel"
    [warning] = got[0]["warnings"]  # once, on the main process only
    assert warning.startswith("weightsync audit (step 2): the set of trainable parameters changed"), warning
    assert PROVEN in warning and TRAINER_FIX in warning and "maybe_rewrap" not in warning
    assert got[1]["warnings"] == []
    recs = got[0]["records"]
    assert [r["in_sync"] for r in recs] == [True, True, True, False, False, False, False], recs
    first_bad = recs[3]
    assert {"body.weight", "body.bias"} <= {m["name"] for m in first_bad["mismatches"]}  # the user's names
    assert PROVEN in first_bad["hints"][0] and first_bad["hints"][0].endswith(TRAINER_FIX), first_bad["hints"]
    assert "DDPRewrapOnTrainableChange" not in first_bad["hints"][0]
    # The head (reduced) follows through max_grad_norm's clipping: named as a consequence, no optimizer load blamed.
    assert any(h.startswith("head.weight, head.bias differ although") for h in first_bad["hints"]), first_bad["hints"]
    assert not any("loaded or reset" in h for h in first_bad["hints"]), first_bad["hints"]


def test_hf_trainer_fix_unfreeze_with_every_parameter_in_the_reducer_keeps_replicas_in_sync(
    runs: dict[str, Any],
) -> None:
    got = _got(runs, "fix")
    assert got[0]["warnings"] == [] and got[1]["warnings"] == []
    recs = got[0]["records"]
    assert len(recs) == 7 and all(r["in_sync"] for r in recs), recs
    body = got[0]["body_at"]
    assert body["0"] == body["2"] != body["3"]  # frozen until step 2, then trained
    assert body == got[1]["body_at"]  # and the same on both ranks


def test_outside_a_trainer_no_trainer_is_found_and_the_callback_audits_the_model_it_is_given() -> None:
    import torch

    from weightsync_audit.integrations.hf.callback import WeightSyncAuditCallback, find_trainer, trainer_ddp

    model = torch.nn.Linear(2, 2)
    assert find_trainer() is None and trainer_ddp(None, model) is None
    assert WeightSyncAuditCallback().audited(model) is model
