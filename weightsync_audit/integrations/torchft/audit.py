"""Audits across torchft replica groups: :class:`TorchFTAudit`, a hook on the Manager's training loop.

Replica groups meet only through torchft's ``Manager``: each audit runs among the members of the current
quorum that reach it, over a channel of their own in the quorum's store
(:mod:`~weightsync_audit.integrations.torchft.channel`), with every wait bounded. An audit that cannot
complete (a group gone, a step one group did not commit) is reported and training goes on: nothing here
holds a quorum up past ``timeout_s``.

When it audits:

- **DDP / HSDP** (``optimizer=``): right before a committed optimizer step (a step pre-hook on the wrapped
  optimizer: ``should_commit()`` said yes, the step has not moved anything yet), every ``every_n_steps``
  committed steps, at every quorum change and at every step where a replica heals. A replica that healed
  is thus verified against its source *before its first committed step*: parameters, buffers, optimizer
  state, the Manager's step, the lr scheduler and any ``must_match`` state. With ``coverage="1/n"`` a
  cadence audit reads slice ``(step // every_n_steps) % n`` of each large tensor (the same on every replica,
  one that joined late too; n cadence audits in a row read every byte); an audit at a quorum change or a
  heal reads every byte.
- **LocalSGD / DiLoCo** (``sync=``): right after a sync committed, and never in between.

Each group rank audits among the same group rank of the other replica groups (its shard, under HSDP).
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import replace
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

from torch import nn

from weightsync_audit.channel.star import DEFAULT_GRACE_S, Comm
from weightsync_audit.engine.auditor import Auditor
from weightsync_audit.engine.config import AuditRequest, parse_coverage, with_checked_options
from weightsync_audit.engine.inventory.manifest import unwrap_module
from weightsync_audit.integrations.session.options import AuditOptions, check_every_n
from weightsync_audit.integrations.session.trainer_session import SessionAdapter, TrainerSession
from weightsync_audit.integrations.torchft.channel import (
    Member,
    QuorumComm,
    ReadInFull,
    Roll,
    call_roll,
    drop_store,
    quorum_store,
)
from weightsync_audit.integrations.torchft.compat import (
    Heals,
    Quorum,
    QuorumTap,
    SyncTargets,
    check_manager,
    group_rank,
    sync_targets,
    wrap_method,
)
from weightsync_audit.integrations.torchft.verdict import AuditPoint, collect, complete
from weightsync_audit.reporting.record import AuditResult

__all__ = ["DEFAULT_EVERY_N_STEPS", "TorchFTAudit"]

DEFAULT_EVERY_N_STEPS = 100
"""Committed steps between two audits when ``every_n_steps`` is not given (without ``sync=``)."""


class QuorumAuditor(Auditor):
    """The engine over the channel of the audit in progress (:attr:`channel`, set per audit)."""

    channel: Optional[QuorumComm] = None
    every_n: int = 1
    """The adapter's cadence: a sampled audit's slice follows the committed step, not this process's count of
    audits (a replica that joined late has fewer), so every member of an audit reads the same slice."""

    def slice_for(self, step: int | None, slices: int | None = None) -> int:
        slices = self.config.slices if slices is None else slices
        return 0 if step is None else (int(step) // self.every_n) % slices

    @property
    def comm(self) -> Comm:
        if self.channel is None:
            raise RuntimeError("weightsync audit: no quorum channel is open (audits run from TorchFTAudit's hooks)")
        return self.channel

    def setup(self) -> None:
        """Nothing to open yet: the channel is made in the quorum's store at an audit, per membership."""


class _Keep:
    """The sink that keeps the records this process took part in (:attr:`TorchFTAudit.results`)."""

    def __init__(self, results: collections.deque[AuditResult]) -> None:
        self.results = results

    def write(self, record: AuditResult) -> None:
        self.results.append(record)


@with_checked_options
class TorchFTAudit(SessionAdapter, contextlib.AbstractContextManager["TorchFTAudit"]):
    """Audit the replica groups of a torchft job at committed steps, after heals and at sync points.

    Args:
        manager: this replica group's ``torchft.Manager``.
        module, optimizer: what is audited under DDP/HSDP (the model or torchft's DDP wrapper; the
            ``OptimizerWrapper`` or the optimizer it wraps, whose step pre-hook is the audit point).
        lr_scheduler: a scheduler (or a list) whose state must be equal on every replica (compared too).
        sync: a ``torchft.local_sgd.LocalSGD`` or ``DiLoCo``: audit at its sync points only (then neither
            ``module``, ``optimizer``, ``lr_scheduler`` nor ``include`` is given: the sync decides them).
        every_n_steps: audit every n committed steps (with ``sync``: every n syncs); quorum changes and
            heals are always audited. ``None``: every 100 committed steps, or every sync.
        must_match: ``{name: callable}`` of further state that must be equal on every replica (numbers,
            strings, tensors, lists or dicts of them), compared at every audit.
        per_replica: names of state that is per replica by design (a dataloader's position): said in the
            record as not compared.
        include, exclude, tolerance: as for :class:`~weightsync_audit.Auditor`.
        coverage: ``1`` (every byte at every audit) or ``"1/n"``: each cadence audit reads one n-th of every
            large tensor (small ones whole), the slice following the committed step so that every replica
            reads the same one, and n cadence audits in a row read every byte; quorum changes and heals are
            always audited in full.
        overlap: not offered (``True`` is refused, saying why): use ``coverage`` to make each audit cheaper.
        timeout_s: the longest any member waits for another at any point of an audit.
        on_mismatch: ``warn`` (report, train on) or ``raise`` (:class:`~weightsync_audit.WeightDivergenceError`
            from the optimizer step on every replica compared). An audit that could not complete is never raised.
        report_path: a JSONL report this process appends each record it takes part in to.
        verbose: print a divergence (rich, stderr) when it appears or changes, else log it; and the summary
            at :meth:`close`.

    The audits are collective among the replicas: every replica group constructs it alike. A doctest
    needs a lighthouse; docs/torchft.md runs a whole job::

        audit = TorchFTAudit(manager, model, optimizer, lr_scheduler=scheduler, every_n_steps=100)
    """

    def __init__(
        self,
        manager: Any,
        module: nn.Module | None = None,
        optimizer: Any = None,
        *,
        lr_scheduler: Any = None,
        sync: Any = None,
        every_n_steps: Optional[int] = None,
        must_match: Mapping[str, Callable[[], Any]] | None = None,
        per_replica: Sequence[str] = (),
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        tolerance: float | None = None,
        coverage: float | str = 1,
        overlap: bool = False,
        timeout_s: float = 10.0,
        on_mismatch: Literal["warn", "raise"] = "warn",
        report_path: str | None = None,
        verbose: bool = True,
    ) -> None:
        _check_arguments(on_mismatch, sync, module, optimizer, lr_scheduler, include, must_match, overlap)
        parse_coverage(coverage)  # answered before the manager is looked at, as every option
        check_manager(manager)
        self.manager = manager
        every = check_every_n(every_n_steps, "every_n_steps")
        self.every_n_steps: int = every if every is not None else (1 if sync is not None else DEFAULT_EVERY_N_STEPS)
        """The cadence in force: committed steps, or syncs with ``sync=``."""
        self.lr_scheduler = lr_scheduler
        self.must_match = dict(must_match or {})
        self.per_replica = tuple(per_replica)
        self.targets: SyncTargets | None = sync_targets(sync) if sync is not None else None
        self.module = module if self.targets is None else self.targets.module
        self.optimizers = (
            self.targets.optimizers if self.targets is not None else [getattr(optimizer, "optim", optimizer)]
        )
        self.results: collections.deque[AuditResult] = collections.deque(maxlen=1024)
        """The records this process took part in (the last 1024)."""
        self.options = AuditOptions(
            include=self.targets.include if self.targets is not None else (include or AuditOptions().include),
            exclude=tuple(exclude), timeout_s=timeout_s, tolerance=tolerance, coverage=coverage,
            on_mismatch=on_mismatch, report_path=report_path, verbose=verbose, sinks=[_Keep(self.results)],
        )  # fmt: skip
        """The options, whole, as every adapter's: the session (:attr:`session`) acts on them alike."""
        self.timeout_s = float(timeout_s)
        self.session = TrainerSession(self.options, self.every_n_steps)
        """The cadence, the audit, the response (warn/raise, report, sinks, summary): as under every adapter."""
        # Every process reports its own records; torchft's DDP syncs no buffer across replicas.
        self.session.open(world_size=1, is_main=True, ddp_broadcast_buffers=False, engine=QuorumAuditor)
        self.runner = self.session.runner
        self.auditor: QuorumAuditor = self.runner.auditor  # type: ignore[assignment]
        self.auditor.every_n = self.every_n_steps
        self._last_quorum: int | None = None
        self._last_in_sync: int | None = None
        self._last_full: int | None = None
        self._names: frozenset[str] | None = None
        self._synced_step = int(manager.current_step())
        self._channel: QuorumComm | None = None
        self._channel_quorum: int | None = None
        self.tap = QuorumTap.install(manager)
        self._undo: list[Callable[[], None]] = []
        if self.targets is None:
            handle = self.optimizers[0].register_step_pre_hook(lambda opt, args, kwargs: self._before_step())
            self._undo.append(handle.remove)
        else:
            for owner, index in self.targets.owners:
                self._undo.append(wrap_method(owner, self.targets.method, self._after_sync_of(index)))

    # -- the audit points -------------------------------------------------------------------------

    def _due(self, quorum: Quorum, heals: Heals, step: int, module: Any, optimizers: list[Any]) -> bool | None:
        """The same answer on every member of ``quorum``, from the quorums they all saw and the step only:
        ``True`` at a quorum change or a heal (read in full), ``False`` at the session's cadence (as every
        adapter's), ``None``: no audit here."""
        changed = quorum.quorum_id != self._last_quorum
        self._last_quorum = quorum.quorum_id
        cadence = self.session.after_step(module, optimizers, step, once=False)
        return True if changed or heals.someone else False if cadence else None

    def _before_step(self) -> None:
        quorum, heals = self.tap.latest, self.tap.take_heals()
        # The committed steps the state holds: should_commit already counted the one about to be taken.
        step = int(self.manager.current_step()) - 1
        full = None if quorum is None else self._due(quorum, heals, step, self.module, self.optimizers)
        if quorum is None or full is None:
            return
        exclude = tuple(self.options.exclude)
        self._audit(quorum, heals, step, "step", self.module, self.optimizers, exclude, None, full)

    def _after_sync_of(self, fragment: int | None) -> Callable[[Any], None]:
        def after(committed: Any) -> None:
            step = int(self.manager.current_step())
            moved, self._synced_step = step != self._synced_step, step
            quorum = self.tap.latest
            if committed is False or not moved or quorum is None:
                return
            heals = self.tap.take_heals()
            targets = self.targets
            assert targets is not None
            full = self._due(quorum, heals, step, targets.module, targets.optimizers)
            if full is None:
                return
            exclude = tuple(self.options.exclude) + targets.per_fragment_exclude.get(fragment or 0, ())
            self._audit(quorum, heals, step, "sync", targets.module, targets.optimizers, exclude, fragment, full)

        return after

    # -- one audit ------------------------------------------------------------------------------

    def _point(self, quorum: Quorum, step: int, point: str, fragment: int | None) -> AuditPoint:
        targets = self.targets
        sync = None
        if targets is not None:
            sync = {"algorithm": targets.algorithm, "every": targets.sync_every}
            if fragment is not None:
                sync["fragment"] = fragment
        if self._names is None:  # once: a heal's hints tell the model's state from the optimizer's by them
            user = unwrap_module(self.module) if self.module is not None else None
            names = (
                [] if user is None else [n for n, _ in user.named_parameters()] + [n for n, _ in user.named_buffers()]
            )
            self._names = frozenset(names)
        return AuditPoint(
            quorum_id=quorum.quorum_id,
            group_rank=group_rank(self.manager),
            point=point,
            step=step,
            include=self.options.include,
            timeout_s=self.timeout_s,
            sync=sync,
            notes=(targets.note(fragment),) if targets is not None else (),
            per_replica=self.per_replica,
            model_names=self._names,
        )

    def _audit(
        self,
        quorum: Quorum,
        heals: Heals,
        step: int,
        point: str,
        module: Any,
        optimizers: list[Any],
        exclude: tuple[str, ...],
        fragment: int | None,
        full: bool,
    ) -> AuditResult | None:
        at = self._point(quorum, step, point, fragment)
        hook = "torchft_step" if point == "step" else f"{self.targets.algorithm.lower()}_sync"  # type: ignore[union-attr]
        where = f"{point}{'' if fragment is None else fragment}"
        prefix = f"weightsync_audit/torchft/{quorum.quorum_id}/{at.group_rank}/{where}/{step}"

        def audit(module: Any, optimizers: Any, *, step: int, epoch: int | None, hook: str) -> AuditResult:
            try:
                # A must_match that fails keeps this replica from the roll: the others name it absent.
                counters, skipped = collect(self.manager, self.lr_scheduler, self.must_match)
                # A heal's evidence ends at the replica's first committed step or sync: a sync replaced what it
                # loaded (its source is still said, but nothing is verified or blamed on it).
                me = Member(
                    quorum.replica_rank,
                    quorum.replica_id(quorum.replica_rank),
                    healed=heals.this_replica and point == "step",
                    source=heals.source,
                    counters=counters,
                    last_in_sync_step=self._last_in_sync,
                    last_full_sync_step=self._last_full,
                )
                result, roll = self._read(quorum, me, prefix, full, exclude, module, optimizers, step, epoch, hook)
            except Exception:
                drop_store(quorum.store_address)  # a client left waiting on a gone host is not reused
                self._open(None)  # nor a channel that may hold a half-done exchange
                raise
            complete(result, roll, at, skipped)
            self._last_in_sync, self._last_full = result.last_in_sync_step, result.last_full_sync_step
            return result

        # The session's response, as every adapter's; an audit that cannot complete warns, never raises.
        return self.session.audit(
            module, optimizers, step=step, epoch=None, hook=hook, is_main=True, audit=audit, failure_warns=True
        )

    def _read(
        self, quorum: Quorum, me: Member, prefix: str, full: bool, exclude: tuple[str, ...], *at: Any
    ) -> tuple[AuditResult, Roll]:
        """The engine's audit (``at``: module, optimizers, step, epoch, hook), its summaries riding the roll under
        ``prefix``: read again in full, under a roll of its own, when the members did not all read alike."""
        module, optimizers, step, epoch, hook = at
        store = quorum_store(quorum.store_address, self.timeout_s + DEFAULT_GRACE_S)
        for again in (False, True):
            where, entry = (
                prefix + ("/full" if again else ""),
                replace(me, channel=self._held(quorum), full=full or again),
            )

            def roll_call(summary: bytes, where: str = where, entry: Member = entry) -> Roll:
                return call_roll(store, where, replace(entry, summary=summary.hex()), quorum.replica_world_size,
                                 self.timeout_s, self.timeout_s + DEFAULT_GRACE_S)  # fmt: skip

            # The last audit's channel is taken over when every member holds it whole (the roll says so).
            comm = QuorumComm(store, where, self.timeout_s, roll_call=roll_call, held=self._channel)
            self._channel = None
            self._open(comm)
            # Before the step, after the all-reduce: the gradients (include grads) in this same audit; every byte
            # at a quorum change or a heal (a decision every member takes from what it saw, checked by the roll).
            request = AuditRequest(include=tuple(self.options.include), exclude=exclude, full=full or again)
            try:
                result = self.auditor.audit(module, optimizers, step=step, epoch=epoch, hook=hook, request=request)
            except ReadInFull:
                continue
            if comm.roll is None:
                raise RuntimeError("weightsync audit: the audit ended before its roll call")
            if comm.prefix == where:  # a channel of its own (not the last one's, taken over)
                self._channel_quorum = quorum.quorum_id
            return result, comm.roll
        raise RuntimeError("weightsync audit: the replicas did not read alike in full")

    def _held(self, quorum: Quorum) -> str | None:
        """The prefix of the channel this member can use again under ``quorum`` (made in it, never failed)."""
        channel = self._channel
        if channel is None or self._channel_quorum != quorum.quorum_id or not channel.whole:
            return None
        return channel.prefix

    def _open(self, channel: QuorumComm | None) -> None:
        """Use ``channel`` from this audit on (``None``: none); the one it replaces is released."""
        if self._channel is not None:
            self._channel.close()
        self._channel = channel
        self.auditor.channel = channel

    # -- lifetime -------------------------------------------------------------------------------

    @property
    def last(self) -> AuditResult | None:
        """The last record this process took part in."""
        return self.results[-1] if self.results else None

    @property
    def failures(self) -> list[str]:
        """Audits that could not complete, noted in the next record."""
        return self.runner.failures

    def close(self) -> None:
        """Remove the hooks, release the channel, close the report; with ``verbose``, print the summary
        (idempotent)."""
        for undo in reversed(self._undo):
            undo()
        if self.session.opened:
            self.session.print_summary(True)
        self._undo.clear()
        self._open(None)
        self.session.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_arguments(
    on_mismatch: str,
    sync: Any,
    module: Any,
    optimizer: Any,
    lr_scheduler: Any,
    include: Any,
    must_match: Any,
    overlap: Any = False,
) -> None:
    """Refuse, naming the arguments, what cannot work together (before anything is hooked)."""
    if overlap is not False:
        raise ValueError(
            f"overlap={overlap!r}: not offered under TorchFTAudit: a heal is verified by an audit the healed "
            "replica's first committed step waits for, and torchft loads a heal's state into the very tensors a "
            "worker thread would be reading (docs/torchft.md, Cost); coverage='1/n' makes each audit cheaper"
        )
    if on_mismatch not in ("warn", "raise"):
        raise ValueError(
            f"on_mismatch={on_mismatch!r}: TorchFTAudit warns or raises; torchft heals a replica from a live "
            "peer itself (a replica that raises restarts and heals), so 'resync' is not offered here"
        )
    if sync is not None:
        given = [n for n, v in (("module", module), ("optimizer", optimizer), ("lr_scheduler", lr_scheduler),
                                ("include", include)) if v is not None]  # fmt: skip
        if given:
            raise ValueError(
                f"sync= and {given[0]}= cannot be given together: at a LocalSGD/DiLoCo sync point "
                "the sync object decides what is equal on every replica (its model, its outer optimizer)"
            )
    elif module is None or optimizer is None:
        raise ValueError("module= and optimizer= are needed without sync= (the optimizer's step is the audit point)")
    if must_match is not None and not all(callable(f) for f in must_match.values()):
        raise TypeError("must_match must map names to callables that return the state to compare")
