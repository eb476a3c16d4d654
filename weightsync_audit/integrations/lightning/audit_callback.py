"""The logic of the ``WeightSyncAudit`` callback, shared by both Lightning namespaces.

It imports nothing from Lightning: ``pytorch_lightning`` and ``lightning.pytorch`` each get a class
that combines this mixin with their own ``Callback`` (Lightning refuses to mix objects of the two).
Every decision that leads to a collective is taken from data that is equal on every rank (the
trainer's step, the gathered audit result), never from ``is_global_zero``; rank zero only writes
the report, prints, and logs.

What a resume must restore (:func:`lightning_resume`): the lr schedulers of ``trainer.lr_scheduler_configs``,
the precision plugin's grad scaler, the fit loop's position and this process's RNG states. Lightning does not
restore RNG states: a run that re-seeds at start gets a note; one that restores them per rank in its
``on_load_checkpoint`` is checked rank by rank, as they stand right after it (the callback's
``on_load_checkpoint``; Lightning draws from the generator before ``on_train_start``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from typing_extensions import override

from weightsync_audit.compat_engines import lightning_next_batch
from weightsync_audit.engine.checkpoints.resume_state import ResumeSources, rng_now
from weightsync_audit.engine.config import OnMismatch, check_flag, checked_options
from weightsync_audit.engine.repair.plan import ResyncSource
from weightsync_audit.integrations.session.options import AuditOptions, check_every_n, with_option_properties
from weightsync_audit.integrations.session.trainer_session import (
    Checkpoint,
    SessionAdapter,
    TrainerSession,
    added_by_env,
)
from weightsync_audit.reporting.jsonl import RecordSink
from weightsync_audit.reporting.record import AuditResult

if TYPE_CHECKING:
    import pytorch_lightning as pl

#: Hooks that may trigger an audit, besides the step cadence.
AUDIT_HOOKS: tuple[str, ...] = (
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_end",
    "on_save_checkpoint",
    "on_before_optimizer_step",
    "on_train_end",
    "on_fit_end",
)


#: Strategies whose ranks hold shards the audit cannot tell apart: XLA's FSDP. FSDP1 (``FSDPStrategy``) and
#: DeepSpeed (``DeepSpeedStrategy``) are audited: the replica adapters (engine/inventory/replicas) compare
#: what has replicas among its holders and count what has one owner; ``ModelParallelStrategy`` builds
#: DTensors, compared among their peers.
_SHARDED_STRATEGIES = ("XLAFSDP",)

_STATE_VERSION = 1


def route_hooks(cls: type, names: Sequence[str], *, to: str) -> None:
    """Define each Lightning hook in ``names`` on ``cls`` (``(trainer, pl_module, *args)``, the batch hooks'
    extra arguments ignored) as ``self.<to>(trainer, name)``: the hooks that only say which hook ran.

    >>> class Probe:
    ...     def seen(self, trainer, hook): print(trainer, hook)
    >>> route_hooks(Probe, ("on_train_epoch_end",), to="seen")
    >>> Probe().on_train_epoch_end("trainer", "module")
    trainer on_train_epoch_end
    """

    def route(name: str) -> Callable[..., None]:
        def hook(self: Any, trainer: Any, pl_module: Any, *args: Any) -> None:
            getattr(self, to)(trainer, name)

        hook.__name__ = hook.__qualname__ = name
        hook.__doc__ = f"Lightning's ``{name}``: ``self.{to}(trainer, {name!r})``."
        return hook

    for name in names:
        setattr(cls, name, route(name))


def sharded_strategy_reason(strategy: Any) -> str | None:
    """Why a strategy's ranks cannot be compared, or ``None`` when they can (DDP, FSDP1, DeepSpeed, DTensors)."""
    name = type(strategy).__name__
    if "ModelParallel" not in name and any(s in name for s in _SHARDED_STRATEGIES):
        return (
            f"{name} shards parameters across ranks in a form weightsync cannot compare (DDP, FSDP1, DeepSpeed "
            "and DTensors are compared; see docs/sharded.md); this run is not audited"
        )
    return None


@with_option_properties()
class WeightSyncAuditMixin(SessionAdapter):
    """Audit that every rank holds the same weights during ``fit``; report, raise or resync.

    Args:
        every_n_train_steps: audit after every N optimizer steps (once per ``global_step``); ``None``
            turns the cadence off. At the default of 100 the cost is one audit (about memory
            bandwidth over the model's bytes) per 100 steps; see docs/performance.md.
        hooks: Lightning hooks that also trigger an audit (``on_train_start`` catches a checkpoint
            loaded differently on some ranks; ``on_train_epoch_end`` gives one record per epoch).
        include, exclude, on_mismatch, resync_src, report_path, timeout_s, coverage, verbose, tolerance,
            pinpoint, pinpoint_ring, pinpoint_coverage, checkpoints, exit_code, sinks, attribution, overlap:
            the fields of :class:`~weightsync_audit.AuditOptions` (documented there and in docs/callback.md);
            grads are audited at ``on_before_optimizer_step``, and rank 0 writes, prints and hands on records.
        check_batches: at each audited optimizer step also compare a digest of every rank's batch (the
            one ``on_train_batch_end`` receives): ranks that trained on identical batches (a sampler that
            is not distributed) are named in the record's notes.
        options: all of the above but the cadence, ``hooks`` and ``check_batches`` as one :class:`~weightsync_audit.AuditOptions`
            (then none of them may be given flat); each also reads as an attribute (``callback.include``).

    Example::

        trainer = pl.Trainer(strategy="ddp", devices=2,
                             callbacks=[WeightSyncAudit(every_n_train_steps=50, on_mismatch="raise")])
    """

    def __init__(
        self,
        every_n_train_steps: Optional[int] = 100,
        hooks: Sequence[str] = ("on_train_start", "on_train_epoch_end"),
        include: Sequence[str] = ("params", "buffers", "optimizer"),
        exclude: Sequence[str] = (),
        on_mismatch: OnMismatch = "warn",
        resync_src: ResyncSource = 0,
        report_path: Optional[str] = None,
        timeout_s: Optional[float] = 600.0,
        coverage: float | str = 1,
        verbose: bool = True,
        tolerance: Optional[float] = None,
        pinpoint: bool = False,
        pinpoint_ring: Optional[int] = None,
        pinpoint_coverage: float | str = 1,
        checkpoints: bool = True,
        exit_code: Optional[int] = None,
        sinks: Sequence[RecordSink] = (),
        attribution: Any = False,
        overlap: bool = False,
        check_batches: bool = False,
        options: AuditOptions | None = None,
        **unknown: Any,
    ) -> None:
        checked_options(type(self).__init__, unknown, type(self).__name__)
        self.check_batches = check_flag(check_batches, "check_batches")
        super().__init__()
        check_every_n(every_n_train_steps, "every_n_train_steps")
        if isinstance(hooks, str):
            hooks = (hooks,)
        if not isinstance(hooks, (list, tuple)):
            raise TypeError(f"hooks={hooks!r}: give a tuple of Lightning hook names from {list(AUDIT_HOOKS)}")
        unknown = [h for h in hooks if h not in AUDIT_HOOKS]
        if unknown:
            raise ValueError(f"hooks={tuple(hooks)!r}: unknown hook(s) {unknown}; choose from {list(AUDIT_HOOKS)}")
        # The options every callback shares, validated (errors name the argument), taken whole by the session.
        self.options = AuditOptions.given(locals(), options)
        self.session = TrainerSession(self.options, every_n_train_steps, check_batches=self.check_batches)
        self.runner = self.session.runner
        self._saving: Any = None
        self.config = self.runner.config
        self.slices = self.config.slices
        self.every_n_train_steps = every_n_train_steps
        self.hooks = tuple(hooks)
        self.env_options: dict[str, Any] | None = None
        """The options of the ``WEIGHTSYNC_AUDIT`` variable when it added this callback (zero-code activation)."""

    @property
    def from_env(self) -> bool:
        """Whether the callback was added by the WEIGHTSYNC_AUDIT variable (zero-code activation)."""
        return added_by_env(self)

    # -- set-up --------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # The one WEIGHTSYNC_AUDIT added next to the Trainer's own steps aside, naming the options dropped.
        if self.session.step_aside(self, trainer.callbacks, WeightSyncAuditMixin, is_main=trainer.is_global_zero):
            return
        reason = sharded_strategy_reason(trainer.strategy)
        opened = self.session.open(world_size=trainer.world_size, is_main=trainer.is_global_zero, disabled=reason)
        if opened and self.checkpoints and "save_checkpoint" not in vars(trainer):
            self._wrap_save(trainer)

    def _wrap_save(self, trainer: Any) -> None:
        """After the Trainer writes a checkpoint (every rank calls ``save_checkpoint``): audit, sidecar."""
        original = trainer.save_checkpoint

        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> None:
            self._saving = None
            original(filepath, *args, **kwargs)
            saved, self._saving = self._saving, None
            self._run(trainer, "on_save_checkpoint", checkpoint=Checkpoint("saved", filepath, saved))

        trainer.save_checkpoint = save_checkpoint

    @property
    def console(self) -> Any:
        """A ``rich.console.Console`` for reports on rank zero (stderr when ``None``)."""
        return self.runner.console

    @console.setter
    def console(self, value: Any) -> None:
        self.runner.console = value

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if "save_checkpoint" in vars(trainer):
            del trainer.save_checkpoint  # the Trainer's own method again
        self.session.close(ended=False)

    # -- triggers ------------------------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.watch(trainer.strategy.model)
        self._maybe_hook(trainer, "on_fit_start")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.start(trainer.global_step)
        if self.checkpoints and trainer.ckpt_path and not getattr(trainer, "sanity_checking", False):
            # Restored from a checkpoint: every rank against its sidecar, before the first step.
            self._run(trainer, "on_train_start", checkpoint=Checkpoint("loaded", trainer.ckpt_path))
            return
        self._maybe_hook(trainer, "on_train_start")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Once per optimizer step: with gradient accumulation several batches share a global_step.
        model, optimizers, step = trainer.strategy.model, list(trainer.optimizers), trainer.global_step
        if self.session.after_step(model, optimizers, step, batch=batch):  # recorded with check_batches only
            self._run(trainer, "on_train_batch_end", after_step=True)  # overlap=True: launched here

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step, also = trainer.global_step, "on_before_optimizer_step" in self.hooks
        optimizers = list(trainer.optimizers)  # as the step reads them (a scheduler may set an lr back after it)
        if self.session.before_step(
            trainer.strategy.model, step, is_main=trainer.is_global_zero, hook=also, optimizers=optimizers
        ):
            self._run(trainer, "on_before_optimizer_step", grads=True, step=step + 1)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.checkpoints and self.session.opened:
            self._saving = checkpoint  # digested once written (the audit runs after the save)
            return
        self._maybe_hook(trainer, "on_save_checkpoint")

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # After the module's own on_load_checkpoint: the RNG as the resume restored it (local, no message).
        self._rng_at_load = rng_now()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe_hook(trainer, "on_fit_end")
        if self.session.opened:
            self.session.print_summary(trainer.is_global_zero)

    def _maybe_hook(self, trainer: Any, hook: str) -> None:
        if getattr(trainer, "sanity_checking", False):
            return  # the sanity check's validation steps change nothing worth auditing
        if hook in self.hooks and hook != "on_before_optimizer_step":
            self._run(trainer, hook)

    # -- the audit -----------------------------------------------------------------------------

    def _run(
        self,
        trainer: Any,
        hook: str,
        grads: bool = False,
        step: int | None = None,
        checkpoint: Checkpoint | None = None,
        after_step: bool = False,
    ) -> AuditResult | None:
        loggers = list(trainer.loggers) if trainer.is_global_zero else []

        def log_metrics(metrics: dict[str, float]) -> None:
            for logger in loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

        step = trainer.global_step if step is None else step
        kw: dict[str, Any] = dict(epoch=trainer.current_epoch, hook=hook, is_main=trainer.is_global_zero)
        if checkpoint is not None and self.session.active:
            rng = self.__dict__.pop("_rng_at_load", None) if checkpoint.event == "loaded" else None
            resume = lightning_resume(trainer, rng, resumed=checkpoint.event == "loaded")
            checkpoint = replace(checkpoint, resume=resume)
            optimizers = trainer.optimizers
        else:
            optimizers = [] if grads else list(trainer.optimizers)
            kw.update(grads=grads, after_step=after_step)
        return self.session.audit(
            trainer.strategy.model, optimizers, checkpoint=checkpoint, step=step, log_metrics=log_metrics, **kw
        )

    # -- reporting and checkpoints -------------------------------------------------------------

    @property
    @override
    def state_key(self) -> str:
        # From the arguments, as Lightning's own callbacks do, so two WeightSyncAudit in one Trainer keep
        # their histories apart; the one the WEIGHTSYNC_AUDIT variable adds is told apart by its source.
        return self._generate_state_key(  # type: ignore[attr-defined]
            every_n_train_steps=self.every_n_train_steps,
            hooks=list(self.hooks),
            include=list(self.include),
            exclude=list(self.exclude),
            coverage=f"1/{self.slices}",
            source="WEIGHTSYNC_AUDIT" if self.from_env else "callbacks",
        )

    @property
    def _legacy_state_key(self) -> str:
        # Lightning falls back to this key when a checkpoint lacks ``state_key``: version 0.1 saved the
        # history under the class name, so runs checkpointed then resume with their history.
        return type(self).__qualname__ + ("[WEIGHTSYNC_AUDIT]" if self.from_env else "")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "history": self.history.state_dict(),
            "last_reported": list(self.runner.voice.thread().last),  # a divergence is printed when it changes
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Old or partial checkpoints keep the defaults for what they lack.
        self.history.load_state_dict(state_dict.get("history", {}))
        self.runner.voice.thread().last = tuple(state_dict.get("last_reported", ()))


route_hooks(
    WeightSyncAuditMixin,
    ("on_train_epoch_start", "on_train_epoch_end", "on_validation_start", "on_validation_end", "on_train_end"),
    to="_maybe_hook",
)


def lightning_resume(trainer: Any, rng_state: Any = None, resumed: bool = False) -> ResumeSources:
    """The resume state of a Lightning ``Trainer`` on this rank, at a save or right after a restore
    (``resumed``); ``rng_state``: the RNG as the callback's ``on_load_checkpoint`` found it (after the
    module's own ``on_load_checkpoint`` restored it).

    The data position is the next batch the fit loop trains (``epoch``, and ``batch``: its index in that
    epoch's pass over the data), as Lightning will resume it (:func:`~weightsync_audit.compat_engines.
    lightning_next_batch`): an end-of-epoch checkpoint resumes at the next epoch's first batch; one saved
    mid-epoch with a plain ``DataLoader`` starts that epoch's data over (the cause is said with the finding).
    """
    configs = getattr(trainer, "lr_scheduler_configs", None) or []
    plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    position: dict[str, int] = {"step": int(trainer.global_step), "epoch": int(trainer.current_epoch)}
    causes: dict[str, str] = {}
    nxt = lightning_next_batch(trainer, resumed)
    if nxt is not None:
        position.update(epoch=int(nxt[0]), batch=int(nxt[1]))
        if nxt[2]:
            causes["data.position"] = nxt[2]
    return ResumeSources(
        lr_schedulers=[c.scheduler for c in configs if hasattr(c.scheduler, "state_dict")],
        grad_scaler=getattr(plugin, "scaler", None),
        data_position=position,
        rng_state=rng_state,
        causes=causes,
    )
