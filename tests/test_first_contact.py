"""The first contact with every peer obeys ``timeout_s`` + grace, on real gloo ranks.

The audit group's gloo pairs connect lazily; a rank that never reaches its first audit once made the
coordinator block about 35 s inside its first ``irecv`` (the lazy connect, gloo's own timeout) before any
deadlined wait began, in about 1 try of 4. The scenario is repeated so that the intermittent case is
seen; each time every waiting rank must name the missing rank within the bound. The silent rank stays
silent until every other rank has given its verdict (or the bound has passed), then leaves: a try lasts
about ``timeout_s``, not the whole bound.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import collect_ranks, start_ranks
from torch import nn

from weightsync_audit import Auditor, AuditTimeoutError
from weightsync_audit.channel.star import DEFAULT_GRACE_S

TIMEOUT_S = 2.0
SLACK_S = 3.0


def _one_rank_never_audits(rank: int, world: int, done: str) -> dict[str, Any] | None:
    torch.manual_seed(0)
    auditor = Auditor(nn.Linear(4, 4), timeout_s=TIMEOUT_S)
    auditor.comm.setup()  # the channel is opened together (as the callbacks do in setup) ...
    if rank == world - 1:
        # ... then this rank never reaches its first audit: it stays alive and silent past the bound, or
        # until every other rank has given its verdict.
        deadline = time.monotonic() + TIMEOUT_S + DEFAULT_GRACE_S + 1
        while time.monotonic() < deadline and len(list(Path(done).iterdir())) < world - 1:
            time.sleep(0.05)
        return None
    t0 = time.monotonic()
    try:
        auditor.audit(step=1)
    except AuditTimeoutError as exc:
        return {"missing": exc.missing_ranks, "elapsed": time.monotonic() - t0}
    finally:
        (Path(done) / str(rank)).touch()
    return {"missing": None, "elapsed": time.monotonic() - t0}


TRIES = [(2, 3), (3, 4), (6, 1)]
"""(world size, tries): every try is a job of its own."""


@pytest.fixture(scope="module")
def tries(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], list[list[Any]]]:
    """Every try of :data:`TRIES`, the jobs side by side (each its own ranks, port and store; they wait on the
    deadline): ``{(world, tries): [each try's results]}``."""
    started = {
        (world, n): [
            start_ranks(_one_rank_never_audits, world, str(tmp_path_factory.mktemp(f"w{world}-try{attempt}")))
            for attempt in range(n)
        ]
        for world, n in TRIES
    }
    return {key: [collect_ranks(job, timeout=90) for job in jobs] for key, jobs in started.items()}


@pytest.mark.slow
@pytest.mark.parametrize("world,n", TRIES)
def test_a_rank_that_never_reaches_its_first_audit_is_named_within_timeout_plus_grace_every_try(
    world: int, n: int, tries: dict[tuple[int, int], list[list[Any]]]
) -> None:
    assert len(tries[world, n]) == n
    for attempt, results in enumerate(tries[world, n]):
        for rank, r in enumerate(results[:-1]):
            assert r is not None and r["missing"] is not None, (attempt, rank, results)
            assert r["elapsed"] < TIMEOUT_S + DEFAULT_GRACE_S + SLACK_S, (attempt, rank, results)
        assert results[0]["missing"] == [world - 1], (attempt, results)
