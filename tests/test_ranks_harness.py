"""The test harness's own promise (tests/ranks.py): a job whose process group could not form is started again,
on another port, and the function under test runs once, on a group that formed."""

from __future__ import annotations

import socket

import pytest
import ranks


def _where(rank: int, world: int) -> tuple[int, int, int]:
    import torch.distributed as dist

    return rank, world, dist.get_world_size()


def test_a_job_whose_process_group_could_not_form_runs_again_on_another_port(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    real = ranks.free_port
    with socket.socket() as taken:  # a port some other process listens on and never answers: the store cannot bind it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first = [taken.getsockname()[1]]
        monkeypatch.setattr(ranks, "free_port", lambda: first.pop() if first else real())
        out = ranks.run_ranks(_where, 2, timeout=60)
    assert out == [(0, 2, 2), (1, 2, 2)]
    assert "the process group did not form (try 1)" in capfd.readouterr().err


def test_a_job_whose_process_group_never_forms_fails_naming_the_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(ranks, "free_port", lambda: taken.getsockname()[1])
        with pytest.raises(ranks.InitFailed, match="rank 0 raised"):
            ranks.run_ranks(_where, 2, timeout=60)
