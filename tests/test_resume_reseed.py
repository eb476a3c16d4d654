"""Resume checks against what the generators and samplers really give back, on 2 forked gloo ranks (LoopAudit).

- Every rank re-seeds 42 at the restart (the documented policy: a note), in the two shapes it takes: the
  ranks saved different states and now hold one alike; or rank 1 saved its seed state (it had not drawn
  since) and rank 0 now holds that. The truth: every rank's generator after the resume is a freshly seeded
  one, compared with ``torch.Generator().manual_seed(42)``'s state.
- ``ResumeSources(sampler=RandomSampler(...))`` with rank 1's RNG file replaced by rank 0's: the truth is the
  order each rank's sampler yields after the resume against the order it would have yielded uninterrupted;
  a ``RandomSampler`` with a generator of its own, that generator restored from rank 0's.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ranks import run_ranks

from weightsync_audit import LoopAudit, ResumeSources


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)


def _draw_all() -> None:
    torch.rand(3), np.random.rand(), random.random()


def _save_then_reseed_42(audit: LoopAudit, path: Path) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Save at ``path`` with this rank's RNG as it stands, re-seed 42 as a restart would, check the resume: the
    torch RNG state saved, the one resumed, the record's ``resume`` entry."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        torch.save(audit.module.state_dict(), path)
    dist.barrier()
    saved_state = torch.get_rng_state()
    audit.checkpoint_saved(path, 4, resume=ResumeSources())
    _seed_all(42)
    now = torch.get_rng_state()
    loaded = audit.checkpoint_loaded(path, 4, resume=ResumeSources())
    return saved_state, now, loaded.checkpoint["resume"] if loaded else None


def _reseeded(rank: int, world: int, out: str) -> dict[str, Any]:
    import torch.distributed as dist

    folder = Path(out)
    model = torch.nn.Linear(4, 2)
    audit = LoopAudit(model, verbose=False)
    fresh42 = torch.Generator().manual_seed(42).get_state()
    seen: dict[str, Any] = {}

    # 1. each rank its own stream, saved apart; the restart seeds 42 on every rank
    _seed_all(100 + rank)
    _draw_all()
    saved_state, now, resume = _save_then_reseed_42(audit, folder / "model.pt")
    seen["collapsed"] = {"resume": resume, "fresh": torch.equal(now, fresh42) and not torch.equal(now, saved_state)}

    # 2. every rank seeded 42 before; rank 0 drew, rank 1 did not (it saved the seed state); the restart seeds 42
    _seed_all(42)
    if rank == 0:
        torch.rand(3)
    saved_state, now, resume = _save_then_reseed_42(audit, folder / "model2.pt")
    seen["from_seed_state"] = {
        "resume": resume,
        "fresh": torch.equal(now, fresh42),
        "own": torch.equal(now, saved_state),
    }

    # 3. a RandomSampler (no state_dict; its order comes from the torch RNG), rank 1 restores rank 0's RNG file
    data = list(range(16))
    sampler = torch.utils.data.RandomSampler(data)
    own_gen = torch.Generator().manual_seed(7 + rank)
    with_gen = torch.utils.data.RandomSampler(data, generator=own_gen)
    _seed_all(100 + rank)
    _draw_all()
    list(with_gen)  # its generator moves on
    for name in ("model3.pt", "model4.pt"):
        if rank == 0:
            torch.save(model.state_dict(), folder / name)
    torch.save({"cpu": torch.get_rng_state(), "gen": own_gen.get_state()}, folder / f"rng{rank}.pt")
    kept = torch.get_rng_state()
    uninterrupted = (list(sampler), list(with_gen))  # what each would yield next; then back to the save
    torch.set_rng_state(kept)
    own_gen.set_state(torch.load(folder / f"rng{rank}.pt", weights_only=True)["gen"])
    dist.barrier()
    audit.checkpoint_saved(folder / "model3.pt", 4, resume=ResumeSources(sampler=sampler))
    audit.checkpoint_saved(folder / "model4.pt", 4, resume=ResumeSources(rng=False, sampler=with_gen))
    torch.manual_seed(1234)  # a fresh process; then rank 1 restores rank 0's file, rank 0 its own
    state = torch.load(folder / f"rng{0 if rank == 1 else rank}.pt", weights_only=True)
    torch.set_rng_state(state["cpu"])
    own_gen.set_state(state["gen"])
    loaded = audit.checkpoint_loaded(folder / "model3.pt", 4, resume=ResumeSources(sampler=sampler))
    seen["random_sampler"] = {
        "resume": loaded.checkpoint["resume"] if loaded else None,
        "resumed": list(sampler),
        "uninterrupted": uninterrupted[0],
    }
    loaded = audit.checkpoint_loaded(folder / "model4.pt", 4, resume=ResumeSources(rng=False, sampler=with_gen))
    seen["sampler_generator"] = {
        "resume": loaded.checkpoint["resume"] if loaded else None,
        "resumed": list(with_gen),
        "uninterrupted": uninterrupted[1],
    }
    audit.close()
    return seen


@pytest.fixture(scope="module")
def reseeded(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_reseeded, 2, str(tmp_path_factory.mktemp("reseed")), timeout=120)


def _details(entry: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f["detail"], f.get("severity", "error")) for f in entry["resume"]["findings"]]


def test_every_rank_reseeded_alike_after_saving_different_states_is_the_documented_note(reseeded: Any) -> None:
    assert all(r["collapsed"]["fresh"] for r in reseeded)  # the truth: every generator freshly seeded, not restored
    entry = reseeded[0]["collapsed"]
    assert entry == {**reseeded[1]["collapsed"], "fresh": True}
    assert entry["resume"]["status"] == "exact"
    assert _details(entry) == [
        (
            "every rank re-seeded the RNG state (torch, numpy, Python random) instead of restoring it "
            "(every rank now holds another state than saved)",
            "note",
        )
    ]


def test_a_reseed_that_lands_on_the_seed_state_one_rank_saved_is_the_same_note(reseeded: Any) -> None:
    # the truth: both generators are freshly seeded; rank 1's equals what it saved only because it never drew
    assert [(r["from_seed_state"]["fresh"], r["from_seed_state"]["own"]) for r in reseeded] == [
        (True, False),
        (True, True),
    ]
    entry = reseeded[0]["from_seed_state"]
    assert entry["resume"]["status"] == "exact"
    assert _details(entry) == [
        ("every rank re-seeded the torch RNG state instead of restoring it (rank 0 now holds another state than saved)",
         "note"),
    ]  # fmt: skip


def test_a_random_sampler_leaves_the_rng_swap_checked_and_is_named_as_unchecked(reseeded: Any) -> None:
    seen = [r["random_sampler"] for r in reseeded]
    # the truth: rank 1's sampler now yields rank 0's next order, rank 0's its own
    assert seen[1]["resumed"] == seen[0]["uninterrupted"] != seen[1]["uninterrupted"]
    assert seen[0]["resumed"] == seen[0]["uninterrupted"]
    entry = seen[0]
    assert entry["resume"]["status"] == "differs"
    assert _details(entry) == [
        ("rank 1 resumed with rank 0's torch RNG state", "error"),
        (
            "the sampler (epoch, seed, rank) is not checked on every rank: RandomSampler has no state_dict() and no "
            "generator of its own (its order comes from the torch RNG, checked as such; its place in an epoch is "
            "not kept)",
            "note",
        ),
    ]


def test_a_random_samplers_own_generator_restored_from_rank_0_is_named(reseeded: Any) -> None:
    seen = [r["sampler_generator"] for r in reseeded]
    assert seen[1]["resumed"] == seen[0]["uninterrupted"] != seen[1]["uninterrupted"]  # the truth
    assert _details(seen[0]) == [("rank 1 resumed with rank 0's sampler (epoch, seed, rank)", "error")]
