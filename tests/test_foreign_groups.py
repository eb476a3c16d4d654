"""The audit opens and decides on every rank whatever process groups another library made first (issue 36).

torch names a group made with ``use_local_synchronization=True`` by hashing its ranks with the number of
groups this process belongs to. Megatron-core's ``initialize_model_parallel`` makes groups that not every
rank belongs to (with pipeline stages: the embedding groups), so that count differed per rank, the audit
group's members rendezvoused under different names, and the first audit waited out its deadline (30 min
without ``timeout_s``). Each layout here is initialised on 4 real gloo ranks, then audited world-wide,
over each of Megatron's groups, and world-wide again; any wait beyond a few seconds fails.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron_state import model_parallel
from ranks import RankFailed, run_ranks
from torch import nn

ps = pytest.importorskip("megatron.core.parallel_state")

from weightsync_audit import AuditTimeoutError, audit  # noqa: E402
from weightsync_audit.channel.star import forget_groups  # noqa: E402

TIMEOUT_S = 4.0
"""Each audit's deadline: a healthy one takes well under a second here; a hang would take this long."""

LAYOUTS = [  # (tensor, pipeline, context, expert) parallel sizes on 4 ranks; issue 36's own layout first
    (1, 2, 1, 1),
    (2, 2, 1, 1),
    (1, 1, 1, 1),
    (2, 1, 1, 1),
    (1, 1, 2, 1),
    (1, 2, 2, 1),
    (1, 1, 1, 2),
    (2, 1, 1, 2),
]


def _groups() -> dict[str, Any]:
    """Megatron's groups this rank belongs to, by name (the ones an audit per group would use)."""
    return {
        "data_parallel": ps.get_data_parallel_group(),
        "data_parallel_with_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "tensor": ps.get_tensor_model_parallel_group(),
        "pipeline": ps.get_pipeline_model_parallel_group(),
        "context": ps.get_context_parallel_group(),
        "expert_data_parallel": ps.get_expert_data_parallel_group(),
        "model_parallel": ps.get_model_parallel_group(),
    }


def _timed_audit(model: nn.Module, opt: torch.optim.Optimizer | None, group: Any = None) -> tuple[bool, float]:
    t0 = time.monotonic()
    result = audit(model, opt, group=group, timeout_s=TIMEOUT_S)
    return result.in_sync, time.monotonic() - t0


def _planted(rank: int, model: nn.Module) -> tuple[list[Any], float]:
    """A world-wide audit with rank 3's first weight moved by 0.5: the mismatch, and how long it took (the
    gap is measured over the data plane, a second gloo group opened on demand)."""
    layer = model["decoder"]["layers"][0]
    with torch.no_grad():
        kept = layer.weight[0, 0].item()
        if rank == 3:
            layer.weight[0, 0] += 0.5
        t0 = time.monotonic()
        result = audit(model, timeout_s=TIMEOUT_S)
        elapsed = time.monotonic() - t0
        layer.weight[0, 0] = kept
    return [(m.name, m.ranks, m.max_abs_diff) for m in result.mismatches], elapsed


def _every_layout(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.ModuleDict({"decoder": nn.ModuleDict({"layers": nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])})})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, planted = [], []
    for layout in LAYOUTS:
        try:
            with model_parallel(*layout):
                seen.append((layout, "world", *_timed_audit(model, opt)))
                for name, group in _groups().items():
                    seen.append((layout, name, *_timed_audit(model, opt, group)))
                seen.append((layout, "world again", *_timed_audit(model, opt)))
                planted.append((layout, *_planted(rank, model)))
        finally:
            # As a new job would: the next layout's audits open their groups after Megatron's.
            forget_groups()
    return {"seen": seen, "planted": planted}


def test_audits_open_and_decide_on_every_rank_after_megatron_made_its_groups_in_every_layout() -> None:
    results = run_ranks(_every_layout, 4, timeout=240)
    for rank, r in enumerate(results):
        assert len(r["seen"]) == len(LAYOUTS) * 9, (rank, r)
        for layout, where, in_sync, elapsed in r["seen"]:
            assert in_sync, (rank, layout, where)
            # A healthy audit takes well under a second; a rank stuck on a peer would take TIMEOUT_S.
            assert elapsed < TIMEOUT_S - 1.0, (rank, layout, where, elapsed)
        for layout, mismatches, elapsed in r["planted"]:
            assert mismatches == [("decoder.layers.0.weight", [3], pytest.approx(0.5))], (rank, layout)
            assert elapsed < TIMEOUT_S - 1.0, (rank, layout, elapsed)


def _plain_subgroups_then_world(rank: int, world: int) -> list[float]:
    """Without Megatron: audits over subgroups that only some ranks belong to change the same count."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    times = [_timed_audit(model, None, pairs[rank // 2])[1]]  # type: ignore[arg-type]
    extra = dist.new_group([0, 1, 2], use_local_synchronization=True) if rank < 3 else None
    del extra
    times.append(_timed_audit(model, None)[1])  # type: ignore[arg-type]
    return times


def test_a_world_audit_opens_after_groups_that_only_some_ranks_belong_to() -> None:
    for times in run_ranks(_plain_subgroups_then_world, 4, timeout=60):
        assert max(times) < TIMEOUT_S - 1.0, times


def _rank_3_audits_another_group(rank: int, world: int, done: str) -> dict[str, Any]:
    import torch.distributed as dist

    pair = dist.new_group([2, 3])
    t0 = time.monotonic()
    try:
        audit(nn.Linear(2, 2), group=pair if rank == 3 else None, timeout_s=TIMEOUT_S)
        out: dict[str, Any] = {"message": None, "elapsed": time.monotonic() - t0}
    except AuditTimeoutError as exc:
        out = {"message": str(exc), "elapsed": time.monotonic() - t0}
    # Rank 0's process serves the job's store: it stays until every rank has its verdict.
    (Path(done) / str(rank)).touch()
    while len(list(Path(done).iterdir())) < world and time.monotonic() - t0 < 3 * TIMEOUT_S:
        time.sleep(0.05)
    return out


def test_ranks_that_open_different_audit_groups_each_raise_within_the_deadline_naming_what_differs(
    tmp_path: Path,
) -> None:
    results = run_ranks(_rank_3_audits_another_group, 4, str(tmp_path), timeout=60, expect_errors=True)
    assert not any(isinstance(r, RankFailed) for r in results), results
    for rank, r in enumerate(results):
        assert r["message"] is not None, (rank, r)
        assert r["elapsed"] < TIMEOUT_S + 6.0, (rank, r)
        # Each side names both views: the world-wide group of ranks 0-2 and rank 3's pair.
        assert "disagree on the audit group" in r["message"], (rank, r)
        assert "[2, 3]" in r["message"] and "[0, 1, 2, 3]" in r["message"], (rank, r)
    # ... in the same words on every rank, on either side of the disagreement.
    assert len({r["message"].split("; the ranks disagree", 1)[1] for r in results}) == 1, results
