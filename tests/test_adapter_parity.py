"""One Trainer session for every adapter: ``LoopAudit`` audits the gradients after the all-reduce as the callbacks
do, and the same planted fault gives the same verdict under ``LoopAudit``, the Lightning and the Hugging Face
callbacks (real Trainers, 2 gloo ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ranks import run_ranks

from weightsync_audit import Auditor, LoopAudit


def _loop_rank(rank: int, world: int, options: dict[str, Any], closure: bool = False) -> list[dict[str, Any]]:
    """SGD, or LBFGS stepped with a closure that runs the forward and backward (``closure``); rank 1 changes a
    gradient after the all-reduce at step 3, before the update (inside the closure with LBFGS)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt: Any = (
        torch.optim.LBFGS(ddp.parameters(), lr=0.1, max_iter=1)
        if closure
        else torch.optim.SGD(ddp.parameters(), lr=0.01)
    )
    seen: list[dict[str, Any]] = []

    class Keep:
        def write(self, record: Any) -> None:
            seen.append(record.to_dict())

    include = ("params", "buffers", "optimizer", "grads")
    with LoopAudit(ddp, opt, every_n_steps=1, include=include, verbose=False, sinks=[Keep()], **options) as audit:
        for step in range(1, 5):
            # each rank its own batch (the all-reduce matters); one for all with LBFGS, which keeps its loss
            batch = torch.full((2, 4), float(step if closure else rank + 1))

            def forward_backward(batch: torch.Tensor = batch, step: int = step) -> torch.Tensor:
                opt.zero_grad()
                loss = ddp(batch).square().sum()
                loss.backward()
                if rank == 1 and step == 3:
                    with torch.no_grad():
                        model[0].weight.grad[0, 0] += 1.0  # after the all-reduce, before the update
                return loss

            if closure:
                opt.step(forward_backward)
            else:
                forward_backward()
                opt.step()
            audit.step(step, 0, batch=batch)
    auditors = [name for name, value in vars(audit.runner).items() if isinstance(value, Auditor)]
    assert auditors == ["auditor"]  # one auditor per run: the gradients' audits and the confirmations are its own
    return seen


OPTIONS = [{}, {"overlap": True}, {"attribution": True}, {"check_batches": True}, {"on_mismatch": "resync"}]


@pytest.mark.parametrize("options", OPTIONS)
def test_loop_audit_with_grads_names_a_gradient_changed_on_one_rank_after_the_all_reduce_with_its_step(
    options: dict[str, Any],
) -> None:
    records = run_ranks(_loop_rank, 2, options)[0]
    grads = [r for r in records if r["hook"] == "before_optimizer_step"]
    assert [r["step"] for r in grads] == [1, 2, 3, 4] and all(r["checked"]["grad"] == 4 for r in grads)
    diverged = [(r["step"], [(m["kind"], m["name"], m["ranks"]) for m in r["mismatches"]]) for r in grads]
    assert [d for d in diverged if d[1]] == [(3, [("grad", "0.weight", [1])])]
    if options.get("on_mismatch") == "resync":  # repaired before the step, confirmed with the gradients compared
        assert grads[2]["action"] == "resynced" and all(r["in_sync"] for r in records if r["hook"] == "step")
        return
    after = next(r for r in records if r["hook"] == "step" and not r["in_sync"])
    assert after["step"] == 3 and [m["name"] for m in after["mismatches"]] == ["0.weight"]
    if options.get("attribution"):
        assert (
            after["blame"]["ranks"] == [1]
            and "gradient of 0.weight changed after the all-reduce" in (after["blame"]["detail"])
        )


@pytest.mark.parametrize("options", [{}, {"overlap": True}])
def test_loop_audit_audits_a_closure_optimizers_gradients_after_its_closure_computed_them(
    options: dict[str, Any],
) -> None:
    # Before: LoopAudit's pre-step hook ran before LBFGS called its closure, so the gradient audit read the
    # previous step's gradients; Lightning's on_before_optimizer_step runs after the closure's backward.
    records = run_ranks(_loop_rank, 2, options, True)[0]
    grads = [r for r in records if r["hook"] == "before_optimizer_step"]
    diverged = [(r["step"], [(m["kind"], m["name"], m["ranks"]) for m in r["mismatches"]]) for r in grads]
    assert [r["step"] for r in grads] == [1, 2, 3, 4]
    assert diverged[2] == (3, [("grad", "0.weight", [1])]), diverged


def _verdicts(records: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each diverged record as the adapters must agree on it: before or after the step, the step, what differs
    where, and the blame."""
    out = []
    for r in records:
        if r["in_sync"]:
            continue
        when = "before" if r["hook"].endswith("optimizer_step") else "after"
        blame = r.get("blame") or {}
        blamed = (blame.get("ranks"), blame.get("evidence"), blame.get("cause"), blame.get("step"))
        out.append((when, r["step"], [(m["kind"], m["name"], m["ranks"]) for m in r["mismatches"]], blamed))
    return out


def test_the_same_planted_gradient_fault_gives_the_same_verdict_under_every_adapter(
    trainer_runs: dict[str, Any],
) -> None:
    # Scenarios of the session's one torchrun launch (tests/conftest.py trainer_runs; adapter_parity_run.py).
    pytest.importorskip("pytorch_lightning")
    runs = trainer_runs
    assert runs["codes"] == [0, 0], runs["log"]
    verdicts = {}
    for name in ("loop", "lightning", "hf"):
        got = runs.get(f"parity_{name}", {}).get(0)
        assert got is not None and "error" not in got, f"{name}: {got}\n{runs['log']}"
        assert all(r["checked"]["grad"] == 2 for r in got["records"] if r["hook"].endswith("optimizer_step"))
        verdicts[name] = _verdicts(got["records"])
    loop = verdicts["loop"]
    assert loop[0][:3] == ("before", 3, [("grad", "layer.weight", [1])])
    assert loop[1][:3] == ("after", 3, [("param", "layer.weight", [1])]) and loop[1][3][:2] == (
        [1],
        "deterministic_difference",
    )
    assert verdicts["lightning"] == loop, verdicts
    assert verdicts["hf"] == loop, verdicts
