"""The overlapped audit: step s digested and compared while step s+1's forward and backward run.

:meth:`OverlapWindow.launch` is called right after an optimizer step, on the training thread, on every
rank. It reads there what is cheap and could change under the audit (the cached manifest's structure
check, the small tensors, the Python values such as learning rates), stamps every audited tensor
(:class:`RaceGuard`), and hands the rest (the large tensors'
digests and every round of the exchange) to one worker thread. The training goes on at once.

The verdict is taken at the next *safe point*: a pre-step hook on every optimizer
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) waits for the worker before any optimizer
writes the audited tensors again; for an optimizer stepped with a closure (LBFGS, Lightning) the wait
runs after the closure's forward and backward, right before the update. The next launch, any other audit
on the same channel, and :meth:`OverlapWindow.close` are safe points too. What the verdict leads to
(``raise``, ``resync``, the report) is done there, on the training thread, so every rank acts at the
same point of its program; the record's ``overlap`` field says which step it covers and where it was
settled.

Collectives stay in one order on every rank: the exchange runs over the audit's own gloo group (never
the default group on which DDP reduces gradients), and the training thread touches that group only
after the worker is done with it (every use settles the pending audit first). A write to an audited
tensor inside the window is named, never compared half-updated: every rank then audits again at rest,
at the safe point.

An overlapped audit never compares a tensor hashed half-updated: :class:`RaceGuard` and :class:`OverlapRun`.

Between one optimizer step and the next the audited tensors are at rest, so their digest can run while
the next forward and backward run; the optimizer's pre-step hook waits for it before the step writes
them. Anything else that writes them in that window (a manual ``p.mul_()``, a WGAN's ``p.clamp_()``, an
EMA kept in a parameter, a buffer the forward updates and the audit compares) would be read mid-write.

Two guards, so that no such write is ever reported as a divergence:

- :class:`RaceGuard` stamps every audited tensor whose digest the worker computes (its version counter
  and its address) when the audit is launched, right after the step, and looks again once the digests
  are done: a write in between is *seen* and named. The tensors stamped are the ones whose counter a
  write moves: the parameters themselves (a cached manifest holds them; a first manifest holds
  ``detach()`` views, which share the parameter's counter) and the optimizer state and buffers
  themselves. The rank that saw a write flags its summary as failed, :class:`OverlapRun` shares every
  rank's reason in one more round and raises :class:`~weightsync_audit.AuditRaceError` on every rank
  together, and the window audits again at rest, before the next optimizer step.
- A **difference** the overlapped read found is never reported from that read: every rank raises the same
  :class:`~weightsync_audit.AuditRaceError` (the verdict is the coordinator's, the same everywhere) and the
  window decides it at rest, where nothing writes, exactly as a synchronous audit would. A divergence thus
  costs one synchronous audit more; a healthy step costs nothing more. That audit reads the tensors again
  and keeps the Python values read at launch (what step s left): a learning rate set for step s+1 before
  the safe point (by the loop, or by a pre-step hook, which a closure optimizer runs before its closure) is
  the next record's to compare.

What no stamp sees, and only the second guard covers: a write through ``.data`` (its alias has a
version counter of its own), through another tensor's raw pointer, by a kernel on another stream that
the training did not order before the launch, or by the hardware. Such a write in the window is not
named; when it made the ranks' reads differ, the audit at rest decides (no false divergence); when every
rank read the same bytes (all before, or all after, the write), the audit stands for what it read.
Small CPU tensors (up to 64 KiB: biases, norms, a BatchNorm's running statistics, optimizer scalars) and
Python values (learning rates) are read at launch, on the training thread, so the next forward updating
running statistics, or a scheduler stepping in the window, changes nothing the audit reads (from the
second audit on, once the manifest is cached; the first one reads everything on the worker, stamped).

>>> import torch
>>> from weightsync_audit import Auditor
>>> model = torch.nn.Linear(4, 2)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> auditor = Auditor(model, opt)
>>> model(torch.ones(1, 4)).sum().backward(); opt.step()
>>> pending = auditor.launch(step=1)      # returns at once; the digest runs on a worker thread
>>> pending.result().in_sync, pending.result().overlap["covers_step"]
(True, 1)
>>> auditor.close()

Where an overlapped audit's device work runs: a side stream ordered after the optimizer step by an event.

On the CPU there is nothing to order: the audit's worker thread reads host memory, and the optimizer's
pre-step hook waits for it. On an accelerator the step's kernels may still be queued when the audit is
launched; :meth:`StreamOrder.at_launch` records an event on the training thread's current stream right
after the step, and the worker's side stream waits for that event before its digest kernels, so they
read the step's result and nothing later, while the training's next forward and backward run on their own
stream. The worker synchronizes its own stream only (:func:`~weightsync_audit.compat.stream_ordered`),
never the device: a device-wide wait would wait for the training's next kernels too.

A write that the step queues on *another* stream than the current one must be ordered before the launch by
the training itself (the stream it ran on waited for, or the current stream made to wait); the synchronous
audit, which waits for the whole device, needs no such care.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from weightsync_audit.channel.store import Call, Worker
from weightsync_audit.compat import stream_ordered, tensor_version
from weightsync_audit.engine.agreement.rounds import Agreement, raise_failed, shared_failures
from weightsync_audit.engine.context import AuditContext, Prepared
from weightsync_audit.engine.hashing.manifest_cache import PreparedManifest
from weightsync_audit.engine.inventory.manifest import before_update
from weightsync_audit.engine.run import AuditRun
from weightsync_audit.errors import AuditRaceError
from weightsync_audit.reporting.record import AuditResult
from weightsync_audit.text import brief_names

__all__ = ["RACE", "OverlapRun", "OverlapWindow", "PendingAudit", "RaceGuard", "StreamOrder", "accelerator_of"]

RACE = AuditRaceError.__name__
"""How a race reads in the shared failure report: ``AuditRaceError: ...``."""


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    try:
        return tensor_version(t), t.data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without storage (meta) has nothing to race on
        return -1, -1


class RaceGuard:
    """The audited tensors' version counters and addresses at launch, to compare once they are digested."""

    def __init__(self, prepared: PreparedManifest) -> None:
        seen: set[int] = set()
        self.tensors: list[torch.Tensor] = []
        later = prepared.sources
        if prepared.in_place is not None and len(prepared.slow_mask) == len(prepared.sources):
            # The small CPU tensors were hashed at launch, at rest: a write to them afterwards (a BatchNorm's
            # running statistics in the next forward) is not this audit's; only what the worker reads counts.
            later = list(itertools.compress(prepared.sources, prepared.slow_mask))
        for t in (*later, *prepared.dynamic):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                self.tensors.append(t)
        self.stamps = list(map(_stamp, self.tensors))

    def moved(self) -> list[torch.Tensor]:
        """The tensors written (or re-pointed) since the stamps were taken."""
        return [t for t, s in zip(self.tensors, self.stamps) if _stamp(t) != s]

    def describe(self, moved: Sequence[torch.Tensor], prepared: PreparedManifest, step: int | None) -> str:
        """What this rank saw, naming the tensors (the manifest is built only here, on a race)."""
        ptrs = {(t.data_ptr(), t.nbytes) for t in moved}
        try:
            names = [e.name for e in prepared.manifest.entries if (_ptr(e.tensor), _nbytes(e.tensor)) in ptrs]
        except Exception:  # noqa: BLE001 - the names are a courtesy; the race stands without them
            names = []
        what = brief_names(names, 5) if names else f"{len(moved)} tensor(s)"
        return (
            f"{what} written while the overlapped audit of step {'-' if step is None else step} read them, "
            "outside the optimizer's step (which waits for the audit): not compared half-updated"
        )


def _ptr(t: Any) -> int:
    return t.data_ptr() if isinstance(t, torch.Tensor) else -1


def _nbytes(t: Any) -> int:
    return t.nbytes if isinstance(t, torch.Tensor) else -1


@dataclass(frozen=True, slots=True, eq=False)
class OverlapRun(AuditRun):
    """An :class:`AuditRun` that checks the :class:`RaceGuard` after digesting and shares a race on every rank."""

    guard: RaceGuard = field(kw_only=True)

    def raced(self, manifest: PreparedManifest) -> BaseException | None:
        """The tensors written since launch, as this rank's failure (its summary flagged failed)."""
        moved = self.guard.moved()
        return AuditRaceError(self.guard.describe(moved, manifest, self.context.step)) if moved else None

    def agree(self, prepared: Prepared) -> Agreement:
        """The summaries meet; a difference in values read in the window is decided at rest (every rank alike)."""
        agreement = AuditRun.agree(self, prepared)  # slots dataclass: no zero-argument super()
        if agreement.status == "values":
            step = self.context.step
            said = (
                f"the overlapped read of step {'-' if step is None else step} differed between the ranks; "
                "decided at rest, where nothing writes (a write in the window that no version counter sees, through "
                ".data or a raw pointer, is never reported as a divergence)"
            )
            raise AuditRaceError(f"weightsync audit: {said}", {r: said for r in self.context.comm.global_ranks})
        return agreement

    def fail(self, failure: BaseException | None) -> None:
        """Every rank's reason, shared; a race on every failed rank is one :class:`AuditRaceError` everywhere."""
        failed = shared_failures(self.context.comm, failure)
        if failed and all(m.startswith(RACE + ":") for m in failed.values()):
            text = "; ".join(f"rank {r}: {m[len(RACE) + 2 :]}" for r, m in failed.items())
            raise AuditRaceError(f"weightsync audit: {text}", failed)
        raise_failed(self.context.comm, failure, failed)


def accelerator_of(tensors: Sequence[Any]) -> torch.device | None:
    """The first accelerator device among ``tensors`` (``None``: all on the CPU, or none at all)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
            return t.device
    return None


class StreamOrder:
    """An event on the training's stream and the side stream that waits for it (one per device, reused)."""

    _side: dict[torch.device, Any] = {}

    def __init__(self, device: torch.device, module: Any, event: Any, side: Any) -> None:
        self.device, self.module, self.event, self.side = device, module, event, side

    @classmethod
    def at_launch(cls, device: torch.device | None) -> StreamOrder | None:
        """On the training thread, right after the step: the event that the worker's stream will wait for."""
        if device is None:
            return None
        module = getattr(torch, device.type, None)
        if module is None or not all(hasattr(module, n) for n in ("Stream", "Event", "current_stream", "stream")):
            return None  # a device type without streams: its work is ordered on the one queue it has
        if device.index is None:
            device = torch.device(device.type, module.current_device())
        side = cls._side.get(device)
        if side is None:
            side = cls._side[device] = module.Stream(device=device)
        event = module.Event()
        event.record(module.current_stream(device))
        return cls(device, module, event, side)

    @classmethod
    def devices(cls) -> list[torch.device]:
        """The devices on which an overlapped audit has had a side stream in this process."""
        return list(cls._side)

    @contextmanager
    def on_worker(self) -> Iterator[None]:
        """On the worker thread: this device current, the side stream current and waiting for the event."""
        with ExitStack() as stack:
            if hasattr(self.module, "device"):
                stack.enter_context(self.module.device(self.device))
            stack.enter_context(self.module.stream(self.side))
            self.side.wait_event(self.event)
            stack.enter_context(stream_ordered())
            yield
            self.side.synchronize()  # nothing the digest queued outlives the audit


class _Auditor(Protocol):
    """What the window reads of its :class:`~weightsync_audit.engine.auditor.Auditor` (no import back up)."""

    def context(self, module: Any = None, optimizer: Any = None, **kw: Any) -> AuditContext: ...

    def run(self, context: AuditContext) -> AuditResult: ...


class PendingAudit:
    """One overlapped audit: launched after step ``step``'s optimizer step, settled before the next one."""

    def __init__(self, window: OverlapWindow, step: int | None, epoch: int | None, hook: str | None) -> None:
        self.step, self.epoch, self.hook = step, epoch, hook
        self._window = window
        self._call: Call | None = None
        """The worker's run of it (:meth:`OverlapWindow.launch` sets it)."""
        self._result: AuditResult | None = None
        self._error: BaseException | None = None
        self.audit_ms = 0.0
        """The worker's time on this audit (digests and exchange)."""
        self.waited_ms: float | None = None
        """How long the training thread waited for it at the safe point (``None``: not settled yet)."""
        self.settled_at: str | None = None
        """The safe point that settled it: ``optimizer pre-step``, ``next launch``, ``another audit``..."""
        self.raced: str | None = None
        """What a race was (then the result is the audit again at rest), else ``None``."""

    def done(self) -> bool:
        """The worker has finished (the verdict is there to take, without waiting)."""
        return self._call is not None and self._call.done.is_set()

    def result(self) -> AuditResult:
        """The verdict (waiting for it, at a safe point, if need be); raises what the audit raised."""
        if self.settled_at is None:
            self._window.settle("result", only=self)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class OverlapWindow:
    """An auditor's overlapped audits: its worker thread, the audit pending, the optimizers' pre-step hook.

    ``on_settled`` (the callbacks' runner sets it) is called on the training thread with each audit as it
    is settled, to act on it; an exception it raises leaves through the safe point (``optimizer.step()``).
    """

    def __init__(self, auditor: _Auditor) -> None:
        self.auditor = auditor
        self.pending: PendingAudit | None = None
        self.on_settled: Callable[[PendingAudit], None] | None = None
        self._worker: Worker | None = None
        self._hook: Any = None
        self._context: AuditContext | None = None

    def launch(self, context: AuditContext) -> PendingAudit:
        """Right after an optimizer step, on every rank, with nothing pending (the auditor settled it): the
        audit of ``context`` (built, its manifest prepared, on this thread) digested and compared on the worker."""
        assert self.pending is None, "settle the pending audit before launching the next"
        pending = PendingAudit(self, context.step, context.epoch, context.hook)
        guard, order = _NO_GUARD, None
        if context.prepared is not None:
            try:
                guard = RaceGuard(context.prepared)
                order = StreamOrder.at_launch(accelerator_of(guard.tensors))
            except Exception as exc:  # noqa: BLE001 - the run reports it to every rank, which raise together
                context = replace(context, prepared=None, failure=exc)
        run = OverlapRun(context, guard=guard)

        def job() -> AuditResult:
            t0 = time.perf_counter()
            try:
                with order.on_worker() if order is not None else nullcontext():
                    return run.run()
            finally:
                pending.audit_ms = (time.perf_counter() - t0) * 1e3

        if self._worker is None:
            self._worker = Worker("weightsync-audit-overlap")
        self._install_hook()
        self._context = context
        self.pending = pending
        pending._call = self._worker.submit(job)
        return pending

    def settle(self, where: str, *, only: PendingAudit | None = None) -> PendingAudit | None:
        """Wait for the pending audit here (a safe point), audit again at rest if it raced, and act on it."""
        pending = self.pending
        if pending is None or (only is not None and pending is not only):
            return None
        self.pending = None
        t0 = time.perf_counter()
        assert pending._call is not None
        pending._call.done.wait()
        pending.waited_ms = (time.perf_counter() - t0) * 1e3
        pending.settled_at = where
        ok, value = pending._call.outcome
        pending._result, pending._error = (value, None) if ok else (None, value)
        error = pending._error
        if isinstance(error, AuditRaceError) and error.raced and self._context is not None:  # on every rank
            raced = self._context
            pending.raced, pending._error = str(error), None
            try:  # at rest now: nothing writes the tensors until this returns; the same evidence (its batch)
                again = self.auditor.context(
                    raced.module, raced.optimizers or None, step=raced.step, epoch=raced.epoch, hook=raced.hook,
                    batch=raced.batch,
                )  # fmt: skip
                if again.prepared is not None and raced.prepared is not None:
                    again.prepared.keep_values(raced.prepared)  # the step's hyper-parameters, not the next's
                pending._result = self.auditor.run(again)
                pending._result.notes.append(f"overlap: {error}; audited again at rest before the next step")
            except Exception as exc:  # noqa: BLE001 - raised from result(), as any audit's error
                pending._error = exc
        if pending._result is not None:
            pending._result.overlap = {
                "covers_step": pending.step,
                "settled_at": where,
                "waited_ms": round(pending.waited_ms, 3),
                "audit_ms": round(pending.audit_ms, 3),
                **({"raced": True} if pending.raced else {}),
            }
        if self.on_settled is not None:
            self.on_settled(pending)
        return pending

    def _install_hook(self) -> None:
        if self._hook is not None:
            return
        me = weakref.ref(self)

        def pre_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            window = me()
            if window is None or window.pending is None:
                return None
            return window._before_step(args, kwargs)

        self._hook = register_optimizer_step_pre_hook(pre_step)

    def _before_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return before_update(
            args,
            kwargs,
            lambda closed: self.settle("optimizer pre-step, after its closure" if closed else "optimizer pre-step"),
        )

    def close(self) -> None:
        """Settle what is pending (acting on it), then remove the hook and end the worker thread."""
        try:
            self.settle("close")
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self._worker is not None:
                self._worker.close()
                self._worker = None


class _NoGuard(RaceGuard):
    """For a launch whose preparation failed: nothing stamped, nothing moves (the run fails anyway)."""

    def __init__(self) -> None:
        self.tensors, self.stamps = [], []


_NO_GUARD = _NoGuard()
