"""Which package modules a repair walks through, and how often it comes back to one it left.

    python benchmarks/trace_resync.py            # plain replicas on 2 ranks, HSDP on 4 ranks

Each case plants a difference on one rank, then traces (``sys.setprofile``, Python calls only) on every
rank:

- ``resync``: ``AuditRunner.run`` with ``on_mismatch="resync"`` (the audit, the plan, the copies and the
  confirming audit); ``repair``: the same run's repair alone (from the plan to the last copy);
- ``audit``: ``Auditor.audit`` of the same model.

Counted on rank 0 (the coordinator), over the modules of ``weightsync_audit`` only:

- ``modules``: the distinct modules a frame ran in;
- ``manifest``: how many manifests were built (``build_manifest`` entered from another module);
- ``channel``: how many rounds went over the channel (a :data:`ROUNDS` method of ``channel/star.py``
  entered from another module; a resync's closing round of the data plane counts too);
- ``returns``: the walk's entries into a module it had already left (the path as a sequence of modules,
  each call from another module a step: the steps that go back to a module seen before), and the number of
  distinct modules so returned to.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from harness import launch, table

import weightsync_audit

PACKAGE = str(Path(weightsync_audit.__file__).resolve().parent) + "/"
MANIFEST = "engine/inventory/manifest.py"
CHANNEL = "channel/star.py"
ROUNDS = frozenset({"decide", "exchange", "exchange_bytes", "exchange_then", "exchange_within", "share_bytes"})
"""The channel's rounds (``Comm``'s methods that talk to the other ranks)."""


def _module(frame: Any) -> str | None:
    name = frame.f_code.co_filename
    return name[len(PACKAGE) :] if name.startswith(PACKAGE) else None


class Trace:
    """The calls into the package's modules while :meth:`run` runs, as a walk of modules."""

    def __init__(self) -> None:
        self.calls: list[str] = []  # the module of every package frame, in call order
        self.walk: list[tuple[str, str]] = []  # (module, function) at each entry from another module

    def hook(self, frame: Any, event: str, _arg: Any) -> None:
        if event != "call" or (here := _module(frame)) is None:
            return
        self.calls.append(here)
        back = frame.f_back
        while back is not None and _module(back) is None:
            back = back.f_back  # through torch or the standard library: the package frame that led here
        if back is None or _module(back) != here:
            self.walk.append((here, frame.f_code.co_name))

    def run(self, fn: Callable[[], Any]) -> Any:
        sys.setprofile(self.hook)
        try:
            return fn()
        finally:
            sys.setprofile(None)

    def mark(self) -> tuple[int, int]:
        return len(self.calls), len(self.walk)

    def counts(self, start: tuple[int, int] = (0, 0), end: tuple[int, int] | None = None) -> dict[str, Any]:
        """The counts (see the module's docstring) of the calls between two marks."""
        end = end or self.mark()
        walk = self.walk[start[1] : end[1]]
        left: set[str] = set()
        returns, returned = 0, set()
        for i, (m, _) in enumerate(walk):
            if m in left:
                returns, returned = returns + 1, returned | {m}
            if i:
                left.add(walk[i - 1][0])
            left.discard(m)
        return {
            "modules": len(set(self.calls[start[0] : end[0]])),
            "manifest": [f for m, f in walk if m == MANIFEST and f == "build_manifest"],
            "channel": [f for m, f in walk if m == CHANNEL and f in ROUNDS],
            "returns": returns,
            "returned": len(returned),
            "names": sorted(set(self.calls[start[0] : end[0]])),
        }


def _plant(rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, hsdp: bool) -> None:
    with torch.no_grad():
        if rank == 1 and not hsdp:
            next(model.parameters()).add_(1e-3)
        if rank == 3 and hsdp:
            model.fc1.weight.to_local().add_(1e-3)  # type: ignore[union-attr,operator]
            opt.state[model.fc1.weight]["exp_avg"].to_local().add_(1.0)  # type: ignore[union-attr]


def _case(rank: int, world: int, hsdp: bool) -> dict[str, Any]:
    from weightsync_audit import Auditor
    from weightsync_audit.engine import respond as respond_module
    from weightsync_audit.integrations.session.options import AuditOptions
    from weightsync_audit.integrations.session.runner import AuditRunner

    if hsdp:
        from mesh_models import hsdp_model, train

        model, _ = hsdp_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train(model, opt, 1, seed=0)
    else:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
    runner = AuditRunner(AuditOptions(on_mismatch="resync", resync_src=0, verbose=False))
    runner.open(world_size=world, is_main=rank == 0)
    runner.run(model, [opt], step=1, epoch=0, hook="on_train_batch_end", is_main=rank == 0)  # warm: lazy imports
    out: dict[str, Any] = {}
    tracer = Trace()
    marks: list[tuple[int, int]] = []
    planned = respond_module.resync_planned

    def traced(*args: Any) -> None:
        marks.append(tracer.mark())
        planned(*args)
        marks.append(tracer.mark())

    _plant(rank, model, opt, hsdp)
    respond_module.resync_planned = traced  # type: ignore[assignment]
    try:
        result = tracer.run(lambda: runner.run(model, [opt], step=2, epoch=0, hook="x", is_main=rank == 0))
    finally:
        respond_module.resync_planned = planned  # type: ignore[assignment]
    out["resync"] = tracer.counts()
    out["repair"] = tracer.counts(*marks)
    out["action"] = result.action
    runner.close()
    auditor = Auditor(model, opt)
    _plant(rank, model, opt, hsdp)
    tracer = Trace()
    tracer.run(lambda: auditor.audit(step=3))
    out["audit"] = tracer.counts()
    return out


def main() -> None:
    rows = []
    for label, world, hsdp in (("plain replicas, 2 ranks", 2, False), ("HSDP (2x2), 4 ranks", 4, True)):
        got = launch(_case, world, hsdp, timeout=600)[0]
        assert got["action"] == "resynced", got["action"]
        for what in ("resync", "repair", "audit"):
            t = got[what]
            rows.append(
                [
                    label,
                    what,
                    str(t["modules"]),
                    str(len(t["manifest"])),
                    str(len(t["channel"])),
                    str(t["returns"]),
                    str(t["returned"]),
                ]
            )
            if "-v" in sys.argv:
                print(label, what, ":", " ".join(t["names"]))
                print("  manifest:", " ".join(t["manifest"]), "\n  channel:", " ".join(t["channel"]))
    print(
        table(["case", "path", "modules", "manifests built", "channel rounds", "returns", "modules returned to"], rows)
    )


if __name__ == "__main__":
    main()
