"""The fixed cost of a small audit: what is said once instead of at every audit, and one figure in the docs.

Real forked gloo ranks; the healthy answer's short cut must leave every other verdict as it was.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch
from ranks import run_ranks

from weightsync_audit import Auditor
from weightsync_audit.engine.inventory.manifest import value_as_tensor

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_hyper_parameters_are_encoded_once_and_exactly() -> None:
    lr, again = value_as_tensor(1e-3), value_as_tensor(1e-3)
    assert lr[0] is again[0] and lr[1] == "float64"  # re-read at every audit: made once
    assert value_as_tensor((0.9, 0.999))[0] is value_as_tensor((0.9, 0.999))[0]
    assert value_as_tensor(None)[0] is value_as_tensor(None)[0]
    assert value_as_tensor(True)[1] == "bool" and value_as_tensor(1)[1] == "int64"  # True == 1, told apart
    zero, minus = value_as_tensor(0.0)[0], value_as_tensor(-0.0)[0]  # equal as keys, not as bytes
    assert zero.numpy().tobytes() != minus.numpy().tobytes()
    assert value_as_tensor((0.0, 1.0))[0].tolist() == [0.0, 1.0]


def _verdicts(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    auditor = Auditor(model, opt)
    out = []
    for step in range(3):
        if step == 2 and rank == world - 1:
            with torch.no_grad():
                model[1].bias.add_(1.0)
        result = auditor.audit(step=step)
        out.append("in_sync" if result.in_sync else ",".join(sorted(m.name for m in result.mismatches)))
    return out


def test_healthy_short_cut_keeps_every_verdict() -> None:
    results = run_ranks(_verdicts, 3)
    assert all(r == results[0] for r in results)
    assert results[0][:2] == ["in_sync", "in_sync"] and "1.bias" in results[0][2]


def test_one_figure_for_the_healthy_message() -> None:
    text = {p.name: p.read_text() for p in DOCS.glob("*.md")}
    sizes = {int(n) for t in text.values() for n in re.findall(r"(\d+)-byte summary", t)}
    assert sizes == {104}, sizes
    perf = text["performance.md"]
    assert "184-byte" in perf and "72-byte answer" in perf


def test_unchanged_hyper_parameters_are_digested_once_and_a_change_is_seen() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    auditor = Auditor(model, opt)
    first, second = auditor.context().prepared, auditor.context().prepared
    third = auditor.context().prepared
    assert first is not None and second is not None and third is not None
    d2, d3 = second.digests(), third.digests()
    assert third.dynamic_digests is second.dynamic_digests  # the same objects: their digests are kept
    assert (d2 == d3).all()
    opt.param_groups[0]["lr"] = 2e-3  # a scheduler's new float: read and digested again
    moved = auditor.context().prepared
    assert moved is not None and moved.dynamic_digests is not second.dynamic_digests
    fresh = Auditor(model, opt).context().prepared  # built, never cached
    assert fresh is not None and (moved.digests() == fresh.digests()).all() and (moved.digests() != d3).any()
    opt.param_groups[0]["betas"] = [0.9, 0.999]  # a list may change in place: never kept
    listed = auditor.context().prepared
    assert listed is not None and listed.dynamic_digests is None
    opt.param_groups[0]["betas"][1] = 0.99
    changed = auditor.context().prepared
    assert changed is not None and (changed.digests() != listed.digests()).any()


def test_wrapper_lookups_read_what_getattr_reads() -> None:
    from weightsync_audit.compat import module_attr, peel_wrapper
    from weightsync_audit.engine.explain.evidence import find_ddp

    plain = torch.nn.Linear(2, 2)
    assert module_attr(plain, "_orig_mod") is None and module_attr(plain, "weight") is plain.weight
    assert peel_wrapper(plain) is None and find_ddp(plain) is None

    class Holds(torch.nn.Module):  # a child named like torch.compile's inner module
        def __init__(self) -> None:
            super().__init__()
            self._orig_mod = torch.nn.Linear(2, 2)

    class Property(torch.nn.Module):
        @property
        def _forward_module(self) -> torch.nn.Module:
            return plain

    class Dynamic(torch.nn.Module):  # its own __getattr__: asked, as getattr asks it
        def __getattr__(self, name: str) -> Any:
            return plain if name == "_orig_mod" else super().__getattr__(name)

    holds = Holds()
    assert module_attr(holds, "_orig_mod") is holds._orig_mod and peel_wrapper(holds) is holds._orig_mod
    assert module_attr(Property(), "_forward_module") is plain
    assert module_attr(Dynamic(), "_orig_mod") is plain and peel_wrapper(Dynamic()) is plain
    assert module_attr(object(), "_orig_mod") is None


def _send_waits(rank: int, world: int, prime: bool) -> list[float]:
    """Seconds each of this rank's audits waited for its summary to be taken, while the coordinator spends
    0.4 s preparing its own (a slow digest, as a large model's)."""
    from weightsync_audit.channel.star import Comm
    from weightsync_audit.channel.wire import StarWire
    from weightsync_audit.engine.run import AuditRun

    model = torch.nn.Linear(4, 2)
    auditor = Auditor(model)
    auditor.setup()
    if not prime:
        Comm.prime = lambda self: None  # type: ignore[method-assign]
    if rank == 0:
        prepare = AuditRun.prepare

        def slow(self: AuditRun) -> Any:
            time.sleep(0.4)
            return prepare(self)

        AuditRun.prepare = slow  # type: ignore[method-assign]
    waits: list[float] = []
    ask = StarWire._ask

    def timed(self: StarWire, group: Any, seq: int, body: bytes, what: str, peer: int, deadline: float) -> Any:
        wait = StarWire._wait

        def first(self: StarWire, group: Any, work: Any, buf: Any, deadline: float) -> None:
            t0 = time.monotonic()
            wait(self, group, work, buf, deadline)
            waits.append(time.monotonic() - t0)
            StarWire._wait = wait  # type: ignore[method-assign]

        StarWire._wait = first  # type: ignore[method-assign]
        return ask(self, group, seq, body, what, peer, deadline)

    StarWire._ask = timed  # type: ignore[method-assign]
    for step in range(2):
        assert auditor.audit(step=step).in_sync
    return waits


def test_a_rank_done_first_hands_its_summary_over_while_the_coordinator_still_digests() -> None:
    """The coordinator posts its receives when the audit starts, before its own digests: the summary of a
    rank done first is taken at once (gloo sends only into a posted receive), not when the coordinator is
    ready. Without it, the same rank's send waits out the coordinator's 0.4 s."""
    primed = run_ranks(_send_waits, 2, True)[1]
    assert len(primed) == 2 and max(primed) < 0.2, primed
    unprimed = run_ranks(_send_waits, 2, False)[1]
    assert min(unprimed) > 0.2, unprimed
