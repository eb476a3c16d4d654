"""The logic of the ``WeightSyncAudit`` callback, shared by both Lightning namespaces.

It imports nothing from Lightning: ``pytorch_lightning`` and ``lightning.pytorch`` each get a class
that combines this mixin with their own ``Callback`` (Lightning refuses to mix objects of the two).
Every decision that leads to a collective is taken from data that is equal on every rank (the
trainer's step, the gathered audit result), never from ``is_global_zero``; rank zero only writes
the report, prints, and logs.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

from typing_extensions import override

from weightsync_audit.ddp.watch import TrainableSetWatch
from weightsync_audit.engine.auditor import Auditor
from weightsync_audit.engine.config import AuditConfig, OnMismatch, check_on_mismatch, parse_coverage
from weightsync_audit.engine.history import AuditHistory
from weightsync_audit.engine.resync import resync
from weightsync_audit.errors import WeightDivergenceError, WeightSyncWarning
from weightsync_audit.reporting.jsonl import ReportWriter, check_report_path
from weightsync_audit.reporting.record import AuditResult

if TYPE_CHECKING:
    import pytorch_lightning as pl

log = logging.getLogger("weightsync_audit")

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


#: Strategies whose ranks hold shards the audit cannot see as DTensors (FSDP1's flat parameters,
#: DeepSpeed's partitions): comparing them as replicas would be wrong. ``ModelParallelStrategy``
#: (Trainer and Fabric) builds FSDP2 / tensor parallel DTensors, which are compared among their peers.
_SHARDED_STRATEGIES = ("FSDP", "DeepSpeed", "XLAFSDP")

_STATE_VERSION = 1


def sharded_strategy_reason(strategy: Any) -> str | None:
    """Why a strategy's ranks cannot be compared as replicas, or ``None`` when they can."""
    name = type(strategy).__name__
    if "ModelParallel" not in name and any(s in name for s in _SHARDED_STRATEGIES):
        return (
            f"{name} shards parameters across ranks in a form weightsync cannot compare (only DTensors, "
            "as built by ModelParallelStrategy / FSDP2 / tensor parallel, are compared shard by shard); "
            "this run is not audited"
        )
    return None


class WeightSyncAuditMixin:
    """Audit that every rank holds the same weights during ``fit``; report, raise or resync.

    Args:
        every_n_train_steps: audit after every N optimizer steps (once per ``global_step``); ``None``
            turns the cadence off. At the default of 100 the cost is one audit (about memory
            bandwidth over the model's bytes) per 100 steps; see docs/performance.md.
        hooks: Lightning hooks that also trigger an audit (``on_train_start`` catches a checkpoint
            loaded differently on some ranks; ``on_train_epoch_end`` gives one record per epoch).
        include: ``params``, ``buffers``, ``optimizer``, ``grads`` (grads at ``on_before_optimizer_step``).
        exclude: glob patterns over names to leave out.
        on_mismatch: ``warn`` (report on rank 0 when a divergence appears or changes), ``raise``
            (``WeightDivergenceError`` on every rank at the same point), ``resync`` (broadcast the
            diverged tensors from ``resync_src`` and confirm).
        resync_src: the rank whose values win in ``resync``.
        report_path: JSONL file that global rank 0 appends one record per audit to.
        timeout_s: deadline for the ranks to meet at an audit (``AuditTimeoutError`` names the missing).
        coverage: ``1`` for full audits, ``1/n`` for sampled audits that cover everything every n audits.
        verbose: print the report and the fit-end summary on rank 0.

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
        resync_src: int = 0,
        report_path: Optional[str] = None,
        timeout_s: Optional[float] = 600.0,
        coverage: float | str = 1,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        if every_n_train_steps is not None and (
            isinstance(every_n_train_steps, bool) or not isinstance(every_n_train_steps, int) or every_n_train_steps < 1
        ):
            raise ValueError(
                f"every_n_train_steps={every_n_train_steps!r}: must be an integer >= 1, or None to turn the cadence off"
            )
        if isinstance(hooks, str):
            hooks = (hooks,)
        unknown = [h for h in hooks if h not in AUDIT_HOOKS]
        if unknown:
            raise ValueError(f"hooks={tuple(hooks)!r}: unknown hook(s) {unknown}; choose from {list(AUDIT_HOOKS)}")
        # One AuditConfig, validated here (errors name the argument), passed whole to the auditors.
        self.config = AuditConfig(
            include=tuple(include) if not isinstance(include, str) else include,  # type: ignore[arg-type]
            exclude=exclude if isinstance(exclude, str) else tuple(exclude),  # type: ignore[arg-type]
            timeout_s=timeout_s,
            slices=parse_coverage(coverage),
        )
        check_on_mismatch(on_mismatch)
        if isinstance(resync_src, bool) or not isinstance(resync_src, int) or resync_src < 0:
            raise ValueError(f"resync_src={resync_src!r}: must be a rank number >= 0")
        if report_path is not None:
            check_report_path(report_path, "report_path")
        self.every_n_train_steps = every_n_train_steps
        self.hooks = tuple(hooks)
        self.include = self.config.include
        self.exclude = self.config.exclude
        self.slices = self.config.slices
        self.on_mismatch = on_mismatch
        self.resync_src = resync_src
        self.report_path = None if report_path is None else str(report_path)
        self.timeout_s = timeout_s
        self.coverage = coverage
        self.verbose = verbose
        self.history = AuditHistory()
        self.console: Any = None
        """A ``rich.console.Console`` for reports on rank zero (stderr when ``None``)."""
        self._auditor: Auditor | None = None
        self._grad_auditor: Auditor | None = None
        self._confirm_auditor: Auditor | None = None
        self._writer: ReportWriter | None = None
        self._disabled: str | None = None
        self._last_step_audited: int | None = None
        self._last_reported: tuple[str, ...] = ()
        self._trainable = TrainableSetWatch()
        self.from_env = False
        """Set when the callback was added by the WEIGHTSYNC_AUDIT variable (zero-code activation)."""

    # -- set-up --------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._disabled = sharded_strategy_reason(trainer.strategy)
        if self.from_env and any(
            isinstance(c, WeightSyncAuditMixin) and c is not self and not c.from_env for c in trainer.callbacks
        ):
            # The Trainer already has its own WeightSyncAudit: the one WEIGHTSYNC_AUDIT added steps aside
            # rather than auditing (and reporting) everything twice.
            self._disabled = "the Trainer already has a WeightSyncAudit; the one from WEIGHTSYNC_AUDIT is not used"
            return
        if self._disabled:
            if trainer.is_global_zero:
                warnings.warn(self._disabled, WeightSyncWarning, stacklevel=2)
            return
        world = trainer.world_size
        if self.on_mismatch == "resync" and self.resync_src >= world:
            raise ValueError(f"resync_src={self.resync_src}: the run has only {world} rank(s)")
        main_include = tuple(k for k in self.include if k != "grads")
        self._auditor = Auditor(config=replace(self.config, include=main_include or ("params",)))
        self._auditor.history = self.history
        if "grads" in self.include:
            self._grad_auditor = Auditor(config=replace(self.config, include=("grads",), slices=1))
        if trainer.is_global_zero and self.report_path is not None:
            self._writer = ReportWriter(self.report_path)
        # Open the audit channel now, while every rank is known to be here (it is collective).
        self._auditor.setup()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- triggers ------------------------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainable.snapshot(trainer.strategy.model)
        self._maybe_hook(trainer, "on_fit_start")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step_audited = trainer.global_step
        self._maybe_hook(trainer, "on_train_start")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe_hook(trainer, "on_train_epoch_start")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # Once per optimizer step: with gradient accumulation several batches share a global_step.
        if self.every_n_train_steps is None or step == self._last_step_audited:
            return
        if step % self.every_n_train_steps == 0:
            self._last_step_audited = step
            self._run(trainer, "on_train_batch_end")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if not self._disabled:
            self._trainable.check(trainer.strategy.model, trainer.global_step, warn=trainer.is_global_zero)
        if self._grad_auditor is None:
            return
        upcoming = trainer.global_step + 1
        on_cadence = self.every_n_train_steps is not None and upcoming % self.every_n_train_steps == 0
        if on_cadence or "on_before_optimizer_step" in self.hooks:
            self._run(trainer, "on_before_optimizer_step", grads=True, step=upcoming)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe_hook(trainer, "on_train_epoch_end")

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe_hook(trainer, "on_validation_start")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe_hook(trainer, "on_validation_end")

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._maybe_hook(trainer, "on_save_checkpoint")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe_hook(trainer, "on_train_end")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe_hook(trainer, "on_fit_end")
        if trainer.is_global_zero and self.verbose and self._auditor is not None:
            self._print(self.summary())

    def _maybe_hook(self, trainer: Any, hook: str) -> None:
        if getattr(trainer, "sanity_checking", False):
            return  # the sanity check's validation steps change nothing worth auditing
        if hook in self.hooks and hook != "on_before_optimizer_step":
            self._run(trainer, hook)

    # -- the audit -----------------------------------------------------------------------------

    def _run(self, trainer: Any, hook: str, grads: bool = False, step: int | None = None) -> AuditResult | None:
        auditor = self._grad_auditor if grads else self._auditor
        if auditor is None or self._disabled:
            return None
        if grads and self._auditor is not None:
            auditor._comm = self._auditor.comm  # one audit channel for both
        model = trainer.strategy.model
        optimizers = [] if grads else list(trainer.optimizers)
        step = trainer.global_step if step is None else step
        epoch = trainer.current_epoch
        t0 = time.perf_counter()
        result = auditor.audit(model, optimizers or None, step=step, epoch=epoch, hook=hook)
        if grads:
            self._note_grad_result(result)
        if result.in_sync:
            result.action = "none"
            self._last_reported = ()
        elif self.on_mismatch == "raise":
            result.action = "raised"
        elif self.on_mismatch == "resync":
            self._resync(trainer, result, model, optimizers, step, epoch, hook)
        else:
            result.action = "warned"
        result.duration_ms = (time.perf_counter() - t0) * 1e3
        self._publish(trainer, result)
        if not result.in_sync and result.action == "raised":
            raise WeightDivergenceError(result)
        return result

    def _note_grad_result(self, result: AuditResult) -> None:
        # The gradient auditor keeps its own history (its audits interleave with the main ones); a
        # divergence it finds first is still the run's first divergence.
        if not result.in_sync:
            self.history.diverged_audits += 1
            if self.history.first_divergence_step is None:
                self.history.first_divergence_step = result.step
                self.history.first_divergence_tensors = result.diverged_names
        result.last_in_sync_step = result.step if result.in_sync else self.history.last_in_sync_step

    def _resync(
        self, trainer: Any, result: AuditResult, model: Any, optimizers: list[Any], step: int, epoch: int, hook: str
    ) -> None:
        structural = [m.name for m in result.mismatches if m.kind == "structure"]
        if structural:
            result.action = "raised"
            result.notes.append(f"resync impossible: the structure differs ({', '.join(structural[:5])})")
            return
        names = [m.name for m in result.mismatches if m.kind != "grad"]
        if names:
            resync(model, optimizers or None, src=self.resync_src, names=names, timeout_s=self.timeout_s)
        if self._confirm_auditor is None:
            assert self._auditor is not None
            cfg = self._auditor.config
            self._confirm_auditor = Auditor(include=cfg.include, exclude=cfg.exclude, timeout_s=cfg.timeout_s)
            self._confirm_auditor._comm = self._auditor.comm
        confirm = self._confirm_auditor.audit(model, optimizers or None, step=step, epoch=epoch, hook=hook)
        if confirm.in_sync:
            result.action = "resynced"
            result.notes.append(
                f"resynced {len(names)} tensor(s) from rank {self.resync_src}; a full audit confirmed the replicas are in sync"
            )
            self.history.resyncs += 1
            self.history.last_in_sync_step = step
        else:
            result.action = "raised"
            result.notes.append(f"resync from rank {self.resync_src} did not restore agreement: {confirm.summary()}")

    def _publish(self, trainer: Any, result: AuditResult) -> None:
        """Report on rank zero: the record, metrics, and a printed report when the divergence changes."""
        if not trainer.is_global_zero:
            if not result.in_sync:
                self._last_reported = tuple(result.diverged_names)
            return
        if self._writer is not None:
            self._writer.write(result)
        metrics = {
            "weightsync/in_sync": float(result.in_sync),
            "weightsync/diverged_tensors": float(len(result.mismatches)),
            "weightsync/audit_ms": float(result.duration_ms),
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        if not result.in_sync:
            names = tuple(result.diverged_names)
            if names != self._last_reported or result.action in ("raised", "resynced"):
                if self.verbose:
                    self._print(result)
                else:
                    log.warning("weightsync audit: %s", result.summary())
            self._last_reported = names

    def _print(self, renderable: Any) -> None:
        from rich.console import Console

        console = self.console or Console(file=sys.stderr)
        console.print(renderable)

    # -- reporting and checkpoints -------------------------------------------------------------

    def summary(self) -> str:
        h = self.history
        if self._disabled:
            return f"weightsync audit: not audited ({self._disabled})"
        if h.diverged_audits == 0:
            last = f", last at step {h.last_in_sync_step}" if h.last_in_sync_step is not None else ""
            return f"weightsync audit: {h.audits} audit(s), replicas in sync throughout{last}"
        first = ", ".join(h.first_divergence_tensors[:5])
        return (
            f"weightsync audit: {h.audits} audit(s), {h.diverged_audits} found divergence; first at step "
            f"{h.first_divergence_step} ({first}); last in sync at step {h.last_in_sync_step}; "
            f"{h.resyncs} resync(s)"
        )

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
            "last_reported": list(self._last_reported),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Old or partial checkpoints keep the defaults for what they lack.
        self.history.load_state_dict(state_dict.get("history", {}))
        self._last_reported = tuple(state_dict.get("last_reported", ()))
