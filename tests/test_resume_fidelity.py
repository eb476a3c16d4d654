"""Resume fidelity per rank with LoopAudit on 2 real gloo ranks: each rank must get back its own RNG,
data position and sampler, and the lr scheduler; the truth is planted (the fault each scenario makes)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ranks import run_ranks

from weightsync_audit import LoopAudit, ResumeSources
from weightsync_audit.engine.checkpoints.resume_rules import compare, saved_differences


def _build(rank: int) -> tuple[Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.arange(32.0).reshape(8, 4))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank, seed=7)
    return model, opt, sched, sampler


def _rng_state() -> dict[str, Any]:
    return {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


SCENARIOS = ("clean", "rng_from_rank0", "sampler_reset", "scheduler_not_restored", "data_from_rank0")


def _loop_resume(rank: int, world: int, out: str) -> dict[str, Any]:
    import torch.distributed as dist

    folder = Path(out)
    model, opt, sched, sampler = _build(rank)
    torch.manual_seed(100 + rank)  # each rank its own stream (dropout-like noise differs per rank)
    np.random.seed(100 + rank)
    random.seed(100 + rank)
    audit = LoopAudit(model, opt, on_mismatch="warn", verbose=False)
    sampler.set_epoch(2)
    for _ in range(4):
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        sched.step()
        torch.rand(3), np.random.rand(), random.random()  # the per-rank streams move on
    path = folder / "step4.pt"
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
    torch.save(_rng_state(), folder / f"rng{rank}.pt")
    position = {"step": 4, "batch": 2, "next_index": list(sampler)[2]}  # where this rank's shard goes on
    (folder / f"data{rank}.json").write_text(json.dumps(position))
    dist.barrier()

    def sources(sched: Any, sampler: Any, position: Any) -> ResumeSources:
        return ResumeSources(lr_schedulers=[sched], sampler=sampler, data_position=position)

    saved = audit.checkpoint_saved(path, 4, resume=sources(sched, sampler, position))
    seen: dict[str, Any] = {"saved": saved.checkpoint["resume"] if saved else None}
    for scenario in SCENARIOS:
        torch.manual_seed(1234)  # a fresh process: the generators start elsewhere
        model2, opt2, sched2, sampler2 = _build(rank)
        state = torch.load(path, weights_only=True)
        model2.load_state_dict(state["model"])
        opt2.load_state_dict(state["opt"])
        if scenario != "scheduler_not_restored":
            sched2.load_state_dict(state["sched"])
        if scenario != "sampler_reset":
            sampler2.set_epoch(2)
        own = 0 if scenario == "rng_from_rank0" else rank  # rank 1's RNG file replaced by rank 0's
        _set_rng(torch.load(folder / f"rng{own}.pt", weights_only=False))
        pos_rank = 0 if scenario == "data_from_rank0" else rank  # every rank restores rank 0's data state
        position2 = json.loads((folder / f"data{pos_rank}.json").read_text())
        audit.module, audit.optimizers = model2, [opt2]
        result = audit.checkpoint_loaded(path, 4, resume=sources(sched2, sampler2, position2))
        assert result is not None
        seen[scenario] = {"status": result.checkpoint["status"], "resume": result.checkpoint["resume"]}
        seen[scenario]["notes"] = result.notes
    audit.close()
    return seen


@pytest.fixture(scope="module")
def loop_resume(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_loop_resume, 2, str(tmp_path_factory.mktemp("resume")), timeout=120)


def _details(seen: dict[str, Any]) -> list[str]:
    return [f["detail"] for f in seen["resume"]["findings"]]


def test_every_rank_holds_the_same_resume_record(loop_resume: list[dict[str, Any]]) -> None:
    assert loop_resume[0] == loop_resume[1]
    saved = loop_resume[0]["saved"]
    assert saved["status"] == "recorded"
    assert {"rng.torch", "rng.numpy", "rng.python", "lr_scheduler", "data.sampler", "data.position"} <= set(
        saved["checked"]
    )


def test_a_clean_resume_is_exact_with_no_finding(loop_resume: list[dict[str, Any]]) -> None:
    clean = loop_resume[0]["clean"]
    assert (clean["status"], clean["resume"]["status"], clean["resume"]["findings"]) == ("matching", "exact", [])
    assert not [n for n in clean["notes"] if n.startswith("resume:")]


def test_rank_1_loading_rank_0s_rng_file_is_named(loop_resume: list[dict[str, Any]]) -> None:
    seen = loop_resume[0]["rng_from_rank0"]
    assert seen["resume"]["status"] == "differs"
    assert _details(seen) == ["rank 1 resumed with rank 0's RNG state (torch, numpy, Python random)"]
    assert seen["status"] == "matching"  # the weights came back: only the RNG did not


def test_a_sampler_reset_to_epoch_0_is_named_on_every_rank(loop_resume: list[dict[str, Any]]) -> None:
    seen = loop_resume[0]["sampler_reset"]
    assert _details(seen) == ["the sampler (epoch, seed, rank) restarted at epoch 0 (saved at epoch 2) on every rank"]


def test_an_lr_scheduler_not_restored_restarted_at_step_0(loop_resume: list[dict[str, Any]]) -> None:
    seen = loop_resume[0]["scheduler_not_restored"]
    assert _details(seen) == ["the lr scheduler restarted at step 0 (saved at step 4) on every rank"]


def test_rank_1_restoring_rank_0s_data_position_is_named(loop_resume: list[dict[str, Any]]) -> None:
    seen = loop_resume[0]["data_from_rank0"]
    assert _details(seen) == ["rank 1 resumed with rank 0's data position"]


def test_ranks_that_saved_different_positions_and_all_resumed_one_is_a_collapse() -> None:
    saved = {str(r): {"data.position": {"digest": f"p{r}"}} for r in range(4)}
    now = {str(r): {"data.position": {"digest": "p0"}} for r in range(4)}
    [finding] = compare(saved, now)
    assert finding["detail"] == (
        "every rank resumed at the same data position (rank 0's) although they saved different ones"
    )
    assert (finding["kind"], finding["ranks"], finding["from_ranks"]) == ("collapsed", [1, 2, 3], [0])


def test_equal_rng_on_every_rank_swapped_is_no_finding_and_unequal_schedulers_at_save_are() -> None:
    one = {"rng.torch": {"digest": "a"}, "lr_scheduler": {"digest": "s"}}
    assert compare({"0": one, "1": one}, {"0": one, "1": one}) == []
    other = {"rng.torch": {"digest": "a"}, "lr_scheduler": {"digest": "t"}}
    [finding] = saved_differences({"0": one, "1": other})
    assert (finding["kind"], finding["ranks"]) == ("unequal", [1])


def _batches(rank: int, world: int, shared: bool) -> list[list[str]]:
    import torch.distributed as dist

    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.arange(64.0).reshape(16, 4))
    # the bug: a sampler told the wrong rank (every rank draws rank 0's shard)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=0 if shared else rank, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    audit = LoopAudit(model, every_n_steps=2, check_batches=True, verbose=False)
    notes = []
    for step, (x,) in enumerate(loader, start=1):
        result = audit.step(step, batch=x)
        if result is not None:
            notes.append([n for n in result.notes if "identical batches" in n])
    audit.close()
    dist.barrier()
    return notes


def test_check_batches_names_ranks_that_trained_on_one_shard_and_stays_quiet_otherwise() -> None:
    shared = run_ranks(_batches, 2, True)
    assert shared[0] == shared[1] and len(shared[0]) == 2
    assert shared[0][0] == [
        "ranks 0, 1 trained on identical batches at step 2: the effective data is divided by 2 there "
        "(a sampler without rank=, or one shard restored on every rank?)"
    ]
    assert run_ranks(_batches, 2, False)[0] == [[], []]


def test_a_sidecar_saved_without_resume_state_leaves_the_resume_unchecked_with_no_finding(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    path = tmp_path / "old.pt"
    torch.save(model.state_dict(), path)
    with LoopAudit(model, verbose=False) as audit:
        audit.checkpoint_saved(path, 3)  # as before resume states were kept
        loaded = audit.checkpoint_loaded(path, 3, resume=ResumeSources())
    assert loaded is not None and loaded.checkpoint["status"] == "matching"
    resume = loaded.checkpoint["resume"]
    assert (resume["status"], resume["findings"]) == ("unchecked", [])
    assert "holds no resume state" in resume["why"] and not loaded.notes
