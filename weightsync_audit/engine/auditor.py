"""The engine: :class:`Auditor` (configuration and history) and :func:`audit` (a one-shot of it).

An audit runs in phases so the healthy case costs one tiny message per rank:

(a) every rank contributes a 104-byte summary (protocol, step, epoch, tensor count, structure digest,
    overall digest, settings digest, sample slice); the coordinator compares them and answers every rank
    a fixed-size verdict; all equal means in sync;
(b) only when the overall digests differ, the per-tensor digests (8 bytes a tensor) go to the
    coordinator, which finds each tensor's majority value and answers only the differing tensors;
(c) only when the structures differ, each rank's manifest (names, kinds, shapes, dtypes, digests) goes
    to the coordinator as JSON, compared name by name there (:mod:`~weightsync_audit.engine.agreement.rounds`);
(d) for at most ``max_diff_tensors`` diverged tensors, the reference rank's copy goes in chunks
    straight to the ranks that differ (the data plane), which measure ``max_abs_diff`` and ``rel_diff``
    (all of them under a ``tolerance``); best effort (:mod:`~weightsync_audit.engine.measure.remote_gaps`).

Every rank receives every decision computed once from the same gathered data, so all of them take the
same path and no collective is ever entered by some ranks only. The phases themselves are
:class:`~weightsync_audit.engine.run.AuditRun`'s methods.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from weightsync_audit.channel.star import Comm
from weightsync_audit.compat import self_check
from weightsync_audit.engine.agreement.consensus import SUMMARY_FIELDS
from weightsync_audit.engine.checkpoints.verify import checkpoint_loaded, checkpoint_saved
from weightsync_audit.engine.config import (
    AuditConfig,
    AuditRequest,
    Method,
    check_module,
    parse_coverage,
    refuse_flat_beside,
    with_checked_options,
)
from weightsync_audit.engine.context import AuditContext, AuditHistory
from weightsync_audit.engine.explain.evidence import find_ddp, syncs_buffers
from weightsync_audit.engine.hashing.manifest_cache import ManifestCache, PreparedManifest
from weightsync_audit.engine.inventory.layouts import declarations
from weightsync_audit.engine.inventory.manifest import Manifest, as_optimizers
from weightsync_audit.engine.inventory.replicas import replica_manifest, stage_module
from weightsync_audit.engine.overlap import OverlapWindow, PendingAudit
from weightsync_audit.engine.repair.plan import RESYNC_KINDS, ResyncState, prepare_resync
from weightsync_audit.engine.run import AuditRun, gc_paused
from weightsync_audit.engine.timeline.pinpoint import DEFAULT_RING, Pinpointer
from weightsync_audit.engine.timeline.step_records import BatchRecords, StallWatch, StepHyper
from weightsync_audit.reporting.record import AuditResult

__all__ = ["Auditor", "audit"]

THE_RUNS_OWN = AuditRequest()
"""An audit of the config's kinds, entered in the run's history: what :meth:`Auditor.audit` makes by default."""
_FULL = AuditRequest(full=True)


@with_checked_options
class Auditor:
    """The audit engine with its configuration and history, for custom training loops.

    Call :meth:`audit` at the same point on every rank (it is collective). Without an initialised
    process group it audits a world of one. The settings come flat (each validated by
    :class:`~weightsync_audit.engine.config.AuditConfig`) or as one ``config=``, whole: then a flat setting
    given beside it (not at its default) is refused with a ``TypeError`` naming each, never silently ignored.

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> auditor = Auditor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    >>> auditor.audit(step=0).in_sync
    True
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        optimizer: Any = None,
        *,
        group: Any = None,
        include: Sequence[str] = ("params", "buffers", "optimizer"),
        exclude: Sequence[str] = (),
        timeout_s: float | None = None,
        coverage: float | str = 1,
        method: Method = "auto",
        max_diff_tensors: int = 8,
        compare_broadcast_buffers: bool = False,
        tolerance: float | None = None,
        pinpoint: bool = False,
        pinpoint_ring: int = DEFAULT_RING,
        pinpoint_coverage: float | str = 1,
        config: AuditConfig | None = None,
        check_finite: bool = False,
    ) -> None:
        # a pipelining PipelineStage or schedule: its stage module
        self.module = stage_module(check_module(module)) if module is not None else None
        self.optimizers = as_optimizers(optimizer)
        self.group = group
        if config is None:
            config = AuditConfig(  # each argument validated there, its error naming it
                include=include,  # type: ignore[arg-type]
                exclude=exclude,  # type: ignore[arg-type]
                timeout_s=timeout_s,
                slices=parse_coverage(coverage),
                method=method,
                max_diff_tensors=max_diff_tensors,
                compare_broadcast_buffers=compare_broadcast_buffers,
                tolerance=tolerance,
                pinpoint=pinpoint,
                pinpoint_ring=pinpoint_ring,
                pinpoint_slices=parse_coverage(pinpoint_coverage, "pinpoint_coverage"),
                check_finite=check_finite,
            )
        elif not isinstance(config, AuditConfig):
            raise TypeError(f"config must be an AuditConfig, got {type(config).__name__}")
        else:  # a flat setting beside it would be ignored
            refuse_flat_beside(Auditor.__init__, locals(), "config", skip=("module", "optimizer", "group"))
        self.config = config
        """The settings, validated once; callbacks build one :class:`AuditConfig` and pass it whole."""
        self.history = AuditHistory()
        self.side_history = AuditHistory()
        """The audits beside the run's own (``AuditRequest(counted=False)``: gradients, confirmations)."""
        self._comm: Comm | None = None
        self._manifests = ManifestCache()
        self._rotate_by_step = False  # the one-shot audit() sets it: no history, so the step picks the slice
        self.pinpointer = Pinpointer(config.pinpoint_ring, config.pinpoint_slices) if config.pinpoint else None
        self.attribution: Any = None
        """The :class:`~weightsync_audit.engine.attribution.watch.StepWatch` whose records a divergent audit
        exchanges to name the corrupted rank (set by the callbacks with ``attribution``); None: the vote."""
        self.batches = BatchRecords() if config.check_batches else None
        """With ``check_batches``: this rank's batch digest per audited step (:meth:`record_batch`)."""
        self.step_hyper: StepHyper | None = None
        """The hyper-parameters each optimizer step read (set by the callbacks, which see the optimizer right
        before the step): a divergent audit names one that differed at a step and was set back since."""
        self._stall = StallWatch(dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)
        self.window: OverlapWindow | None = None
        """The overlapped audits (:meth:`launch`), made at the first one."""
        self._diverged: tuple[AuditResult, ResyncState] | None = None  # the last audit's, when it diverged

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def comm(self) -> Comm:
        if self._comm is None:
            self_check()  # fail loudly, naming the versions, if an internal the channel needs is gone
            self._comm = Comm(self.group, self.config.timeout_s)
        return self._comm

    def setup(self) -> None:
        """Open the audit channel now (collective); otherwise the first audit does it."""
        self.comm.setup()

    def _skip_buffers_reason(self, ddp: Any) -> str | None:
        broadcast = self.config.ddp_broadcast_buffers
        if broadcast is None:
            broadcast = ddp is not None and syncs_buffers(ddp)
        if broadcast and not self.config.compare_broadcast_buffers:
            return (
                "DistributedDataParallel(forward_sync_buffers=True, formerly broadcast_buffers=True) overwrites "
                "them from its first rank at every forward"
            )
        return None

    def prepare(
        self,
        module: nn.Module | None,
        optimizers: list[torch.optim.Optimizer],
        *,
        ddp: Any,
        include: tuple[str, ...] | None = None,
    ) -> PreparedManifest:
        """This audit's manifest: built once and reused while the audited structure holds (see manifest_cache).

        ``ddp`` is the wrapper found once for this audit (or ``None``): it decides whether buffers are skipped.
        ``include``: the kinds this audit compares (default: the config's), each kept in the one cache.
        """
        cfg = self.config
        include = cfg.include if include is None else include
        skip = self._skip_buffers_reason(ddp)
        key = (include, cfg.exclude, skip, self.comm.global_ranks, declarations())  # declared later: built again

        def build() -> Manifest:  # under the replica rules: DeepSpeed, FSDP1, stages...
            return replica_manifest(module, optimizers, include, exclude=cfg.exclude, skip_buffers_reason=skip)

        return self._manifests.prepare(module, optimizers, key=key, build=build, method=cfg.method, kinds=include)

    def slice_for(self, step: int | None, slices: int | None = None) -> int:
        """The sample slice this audit hashes: by audit count, or by ``step`` in the one-shot API.

        Every rank computes it from values that must agree (the audit count, the step), and the slice
        is part of the gathered summary, so ranks that disagree are reported out of step.
        """
        slices = self.config.slices if slices is None else slices
        if self._rotate_by_step and step is not None:
            return int(step) % slices
        return self.history.audits % slices

    def record_step(self, step: int, module: nn.Module | None = None, optimizer: Any = None) -> None:
        """``pinpoint=True``: digest, locally, what the audit covers; call it after every optimizer step."""
        if self.pinpointer is None:
            raise RuntimeError("record_step needs Auditor(pinpoint=True)")
        if self.window is not None:  # the ring the pending audit's summary reads: settled before it moves
            self.window.settle("next launch")
        self._diverged = None  # a step was taken: what the last audit prepared is no longer what is held
        mod, opts = self._targets(module, optimizer)
        ddp = find_ddp(mod) if mod is not None else None
        digest = self.pinpointer.record_step(step, lambda: self.prepare(mod, opts, ddp=ddp), self.config.method)
        self._stall.check(step, digest, opts)  # a step that changed nothing, with lr > 0: warned

    def record_batch(self, step: int, batch: Any) -> None:
        """``check_batches=True``: digest this rank's ``batch`` of ``step`` (local); the audit covering ``step``
        compares it across ranks."""
        if self.batches is None:
            raise RuntimeError("record_batch needs AuditConfig(check_batches=True)")
        self.batches.record(step, batch)

    def repaired(self, step: int | None) -> None:
        """A repair was confirmed at ``step`` (every rank holds the same values): every per-step record about
        the divergence it ended is dropped (pinpoint's ring, attribution's records and blame, batch digests),
        and what is held now is the baseline the next records are taken against. Local, no message."""
        self._diverged = None
        if self.pinpointer is not None and step is not None:
            self.pinpointer.restart(step)  # pinpoint starts afresh: no pre-resync entry stays
        if self.attribution is not None:
            self.attribution.repaired()
        if self.batches is not None:
            self.batches.clear()

    # -- the audit -----------------------------------------------------------------------------

    def context(
        self,
        module: nn.Module | None = None,
        optimizer: Any = None,
        *,
        request: AuditRequest = THE_RUNS_OWN,
        batch: str | BatchRecords | None = None,
        **at: Any,
    ) -> AuditContext:
        """Everything one audit reads, built here and only here, for :meth:`audit` and :meth:`launch` alike.

        ``request``: the kinds, ``full`` (every byte this once, whatever ``coverage`` says) and whether the
        audit is the run's own (``counted``: its history and per-step evidence). ``batch``: this rank's batch
        digest (a digest, or the records to take the one of ``step`` from). The manifest is prepared now, on
        the calling thread, after the coordinator posted its receives (:meth:`Comm.prime`); an error preparing
        it travels in the context, so that every rank raises together. ``at``: the ``step``, ``epoch`` and
        ``hook`` the audit covers, as :class:`AuditContext` names them."""
        step = at.get("step")
        for name in ("step", "epoch"):
            value = at.get(name)
            if value is not None and (isinstance(value, bool) or not hasattr(value, "__index__")):
                raise TypeError(f"{name}={value!r}: must be an integer, or None")
        module, optimizers = self._targets(module, optimizer)
        self.comm.prime()  # the arguments hold: the coordinator's receives are posted before its digests
        ddp = find_ddp(module) if module is not None else None
        config = request.config(self.config)
        prepared, failure = None, None
        try:
            with gc_paused():
                prepared = self.prepare(module, optimizers, ddp=ddp, include=config.include)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the run, which raise together
            failure = exc
        if not request.counted:  # beside the run's own audits: attribution's records read, none consumed
            return AuditContext(
                config, self.comm, self.side_history, None, self.attribution, module, optimizers, ddp, prepared,
                failure, slice_index=0, request=request, **at,
            )  # fmt: skip
        if isinstance(batch, BatchRecords):
            batch = batch.take(step)
        return AuditContext(
            config, self.comm, self.history, self.pinpointer, self.attribution, module, optimizers, ddp,
            prepared, failure, slice_index=self.slice_for(step, config.slices), batches=self.batches,
            batch=batch, step_hyper=self.step_hyper, request=request, **at,
        )  # fmt: skip

    @with_checked_options
    def audit(
        self,
        module: nn.Module | None = None,
        optimizer: Any = None,
        *,
        step: int | None = None,
        epoch: int | None = None,
        hook: str | None = None,
        full: bool = False,
        request: AuditRequest | None = None,
    ) -> AuditResult:
        """Compare every rank's tensors; collective over the group. Returns the same result everywhere.

        ``full``: read every byte this once, whatever ``coverage`` says (every rank passes the same; a
        checkpoint's ``verified`` needs it). ``request``: what else this audit covers
        (:class:`~weightsync_audit.engine.config.AuditRequest`: the kinds, and whether it is the run's own
        or one beside it, as the gradients before a step and a repair's confirmation are). The phases (prepare, agree, localize, measure, explain,
        record) are :class:`AuditRun`'s. An overlapped audit still pending (:meth:`launch`) is settled
        first: the channel is used in order."""
        if self.window is not None:
            self.window.settle("another audit")
        if request is None:  # the two usual requests are made once (``full`` checked as AuditRequest does)
            request = THE_RUNS_OWN if full is False else _FULL if full is True else AuditRequest(full=full)
        elif full is not False and not request.full:
            request = dataclasses.replace(request, full=full)
        batch = self.batches  # this step's digest, consumed by the audit that covers it
        ctx = self.context(module, optimizer, step=step, epoch=epoch, hook=hook, request=request, batch=batch)
        return self.run(ctx)

    def run(self, context: AuditContext) -> AuditResult:
        """:meth:`audit` of a context built by :meth:`context` (collective), on the calling thread."""
        self._diverged = None
        result, prepared = AuditRun(context).phases()
        diverged = frozenset(m.name for m in result.mismatches if m.kind in RESYNC_KINDS)
        comm, module, optimizers = context.comm, context.module, context.optimizers
        state = ResyncState(comm, module, optimizers, prepared, diverged) if result.mismatches else None
        self._diverged = (result, state) if state is not None else None
        return result

    def resync_state(self, result: AuditResult, module: nn.Module | None = None, optimizer: Any = None) -> ResyncState:
        """What a resync right after ``result`` reads (:func:`~weightsync_audit.engine.repair.resync.resync_planned`).

        This auditor's channel, and when ``result`` is its last audit's, diverged, on the same module and
        optimizers, with no step taken since, the manifest that audit built under the replica rules (nothing
        built twice); otherwise a manifest is built when the resync first reads it."""
        module, optimizers = self._targets(module, optimizer)
        kept = self._diverged
        if kept is not None and kept[0] is result and kept[1].module is module and kept[1].optimizers == optimizers:
            return kept[1]
        return prepare_resync(module, optimizers, self.comm)

    def _targets(self, module: Any, optimizer: Any) -> tuple[nn.Module | None, list[torch.optim.Optimizer]]:
        """The module (a pipelining stage's own) and the optimizers a call names, else this auditor's."""
        module = stage_module(module) if module is not None else self.module
        return module, as_optimizers(optimizer) if optimizer is not None else self.optimizers

    def launch(
        self,
        module: nn.Module | None = None,
        optimizer: Any = None,
        *,
        step: int | None = None,
        epoch: int | None = None,
        hook: str | None = "step",
    ) -> PendingAudit:
        """Audit off the critical path: call right after ``optimizer.step()`` on every rank (collective).

        Returns at once; the digests and the exchange run on a worker thread while the next forward and
        backward run, and every optimizer's next step waits for them first (docs/performance.md). The
        result (:meth:`PendingAudit.result`) covers ``step``; a write to an audited tensor meanwhile,
        outside the optimizer, is named and the step audited again at rest. Call :meth:`close` at the end.
        See :mod:`weightsync_audit.engine.overlap` for an example."""
        if self.window is None:
            self.window = OverlapWindow(self)
        self.window.settle("next launch")
        self.comm.setup()  # opened (collective) on the training thread, with every rank here
        # The same context a synchronous audit builds, on the training thread: only the scheduling differs.
        context = self.context(module, optimizer, step=step, epoch=epoch, hook=hook, batch=self.batches)
        pending = self.window.launch(context)
        self._diverged = None  # the next verdict is the worker's: its manifest stays its own
        return pending

    def close(self) -> None:
        """Settle an overlapped audit still pending and stop its worker thread (a no-op without :meth:`launch`)."""
        if self.window is not None:
            window, self.window = self.window, None
            window.close()

    def checkpoint_saved(self, path: Any, step: int | None, *, state: Any = None, **kwargs: Any) -> AuditResult:
        """After saving a checkpoint at ``path``: audit and write its sidecar (collective; see docs/restarts.md).

        ``state``: what was saved (default: the module's ``state_dict``). The result's ``checkpoint`` says
        ``verified`` when every replica agreed at this step."""
        return checkpoint_saved(self, path, step, state=state, **kwargs)

    def checkpoint_loaded(self, path: Any, step: int | None = None, *, state: Any = None, **kwargs: Any) -> AuditResult:
        """After loading the checkpoint at ``path``, before the first step: audit, and compare what every rank
        holds with the sidecar (collective). A tensor that differs from what was saved is a mismatch."""
        return checkpoint_loaded(self, path, step, state=state, **kwargs)


@with_checked_options
def audit(
    module: nn.Module | None,
    optimizer: Any = None,
    *,
    group: Any = None,
    include: Sequence[str] = ("params", "buffers", "optimizer"),
    exclude: Sequence[str] = (),
    step: int | None = None,
    epoch: int | None = None,
    timeout_s: float | None = None,
    coverage: float | str = 1,
    method: Method = "auto",
    tolerance: float | None = None,
    check_finite: bool = False,
) -> AuditResult:
    """Compare parameters, buffers and optimizer state across ranks, once. Collective.

    With ``coverage="1/n"`` the slice of every large tensor it hashes rotates with ``step``
    (``step % n``), so successive calls read every byte; without a step it reads slice 0.

    >>> import torch
    >>> from weightsync_audit import audit
    >>> model = torch.nn.Linear(4, 2)
    >>> result = audit(model, step=0)   # no process group: a world of one
    >>> result.in_sync, result.checked["param"]
    (True, 2)"""
    auditor = Auditor(
        module,
        optimizer,
        group=group,
        include=include,
        exclude=exclude,
        timeout_s=timeout_s,
        coverage=coverage,
        method=method,
        tolerance=tolerance,
        check_finite=check_finite,
    )
    auditor._rotate_by_step = True
    return auditor.audit(step=step, epoch=epoch)


# The summary layout is part of the protocol: keep its length in one place.
assert len(SUMMARY_FIELDS) == 9
