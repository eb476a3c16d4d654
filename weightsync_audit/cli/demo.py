"""``demo``: Lightning #20340 on CPU ranks, first as reported, then with the fix.

Each run is a real ``Trainer.fit`` under ``strategy="ddp_fork"`` on gloo, with the bug report's model,
data and ``BackboneFinetuning(unfreeze_backbone_at_epoch=3)``, audited after every optimizer step. Rank
zero drives a rich progress display and prints the audit's report when the replicas part; the parent
reads each run's JSONL report afterwards and says what it holds.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.rule import Rule
from rich.text import Text

from weightsync_audit.cli import CliError
from weightsync_audit.errors import WeightSyncWarning
from weightsync_audit.reporting.render import log_console
from weightsync_audit.reporting.summary import ReportSummary, diverged_ranks, fmt_step

__all__ = ["DESCRIPTION", "EXAMPLES", "SUMMARY", "add_arguments", "run", "run_demo"]


SUMMARY = "run Lightning #20340 on CPU ranks: the divergence found and explained, then fixed"

DESCRIPTION = """
    Train the bug report's model twice with DDP on CPU ranks: as reported (the replicas part at epoch 3, when
    BackboneFinetuning unfreezes the backbone) and with DDPRewrapOnTrainableChange (in sync throughout). Every step
    is audited; the reports are written as JSONL. Exit 0 when the audit tells the two runs apart as expected, 1 when
    it does not, 2 on an error.
"""

EXAMPLES = """
    example:
      weightsync-audit demo --ranks 2 --epochs 5 --report ./demo-reports
      weightsync-audit show ./demo-reports/without-fix.jsonl
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``demo``'s arguments."""
    p.add_argument("--ranks", type=int, default=2, help="number of CPU ranks (default: 2)")
    p.add_argument(
        "--epochs", type=int, default=5, help="epochs per run; the backbone unfreezes at epoch 3 (default: 5)"
    )
    p.add_argument(
        "--report", metavar="DIR", help="folder for without-fix.jsonl and with-fix.jsonl (default: a temp folder)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when the audit told the two runs apart as expected."""
    return run_demo(ranks=args.ranks, epochs=args.epochs, report_dir=args.report)


_QUIET_LOGGERS = ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric")


def _progress_callback(base: type, audit: Any, label: str) -> Any:
    class DemoProgress(base):  # type: ignore[misc, valid-type]
        """Rank zero's progress bar; the audit callback's reports print above it."""

        def __init__(self) -> None:
            super().__init__()
            self.progress: Progress | None = None
            self.task: Any = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if not trainer.is_global_zero:
                return
            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn("epoch {task.fields[epoch]}  {task.fields[state]}"),
                TimeElapsedColumn(),
                console=log_console(),
                transient=False,
            )
            audit.console = self.progress.console
            console = self.progress.console

            def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
                if issubclass(category, WeightSyncWarning):
                    console.print(Text(f"warning: {message}", style="yellow"))

            warnings.showwarning = show
            self.task = self.progress.add_task(
                label, total=int(trainer.estimated_stepping_batches), epoch=0, state=self._state()
            )
            self.progress.start()

        def _state(self) -> str:
            h = audit.history
            if h.diverged_audits:
                return f"[red]DIVERGED since step {h.first_divergence_step}[/red]"
            return f"[green]in sync ({h.audits} audits)[/green]"

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if self.progress is not None:
                self.progress.update(
                    self.task, completed=trainer.global_step, epoch=trainer.current_epoch, state=self._state()
                )

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if self.progress is not None:
                self.progress.update(self.task, completed=trainer.global_step, state=self._state())
                self.progress.stop()
                self.progress = None

    return DemoProgress()


def _fit(ranks: int, epochs: int, report: Path, fixed: bool, label: str) -> None:
    try:
        from weightsync_audit.lightning.pytorch_lightning import DDPRewrapOnTrainableChange, WeightSyncAudit
    except ModuleNotFoundError as exc:  # Lightning is an extra: say what to install
        raise CliError(f"the demo is a Lightning run: {exc}") from None
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import BackboneFinetuning

    from weightsync_audit.cli.lightning_20340 import UNFREEZE_EPOCH, SeedModel, make_loader

    audit = WeightSyncAudit(every_n_train_steps=1, hooks=("on_train_start",), report_path=str(report), verbose=True)
    callbacks: list[Any] = [BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE_EPOCH), audit]
    callbacks += [DDPRewrapOnTrainableChange()] if fixed else []
    callbacks.append(_progress_callback(pl.Callback, audit, label))
    quiet = dict.fromkeys(("enable_progress_bar", "enable_model_summary", "enable_checkpointing", "logger"), False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=ranks, strategy="ddp_fork", max_epochs=epochs, callbacks=callbacks,
        num_sanity_val_steps=0, **quiet,
    )  # fmt: skip
    model, loader = SeedModel(), make_loader(0)
    trainer.fit(model, loader)


def run_demo(ranks: int = 2, epochs: int = 5, report_dir: str | None = None, console: Console | None = None) -> int:
    """Run the seed scenario without and with the fix; 0 when the audit tells them apart as expected.

    >>> # run_demo(ranks=2, epochs=5)   # about 10 s on 2 cores; or: weightsync-audit demo
    """
    from weightsync_audit.cli.lightning_20340 import UNFREEZE_EPOCH

    if ranks < 2:
        raise CliError(f"--ranks {ranks}: a replica audit needs at least 2 ranks")
    if epochs < 1:
        raise CliError(f"--epochs {epochs}: must be at least 1")
    console = console or log_console()
    out = Path(report_dir) if report_dir else Path(tempfile.mkdtemp(prefix="weightsync-demo-"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"--report {out}: cannot create the folder ({exc.strerror or exc})") from None
    steps = 64 // (2 * ranks)
    console.print(_rule(console, "weightsync-audit demo: Lightning #20340"))
    console.print(
        f"A 32->16 backbone and a 16->2 head on {ranks} CPU ranks (DDP over gloo), {epochs} epochs of {steps} steps. "
        f"BackboneFinetuning freezes the backbone before DDP wraps the model and unfreezes it at epoch {UNFREEZE_EPOCH}; "
        "DDP never learns that the backbone became trainable. WeightSyncAudit checks every step."
    )
    runs = (
        ("without-fix.jsonl", False, "run 1/2: as reported", "without fix"),
        ("with-fix.jsonl", True, "run 2/2: with DDPRewrapOnTrainableChange", "with fix"),
    )
    summaries = []
    saved = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    try:
        for name in _QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        for filename, fixed, title, label in runs:
            report = out / filename
            report.unlink(missing_ok=True)
            console.print(_rule(console, title, "dim"))
            sys.stdout.flush()  # the ranks are forked: nothing buffered may be inherited and printed twice
            sys.stderr.flush()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                warnings.simplefilter("always", WeightSyncWarning)
                _fit(ranks, epochs, report, fixed, label)
            summary = ReportSummary.read(report)
            summaries.append(summary)
            console.print(_verdict(summary))
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
    broken, fixed_run = summaries
    console.print(_rule(console, "what the demo showed", "dim"))
    ok = fixed_run.status == "in_sync"
    if epochs > UNFREEZE_EPOCH:
        ok = ok and broken.status == "diverged"
        console.print(
            f"As reported, the replicas part at the first step of epoch {UNFREEZE_EPOCH}; with "
            "DDPRewrapOnTrainableChange the re-created DDP wrapper all-reduces the backbone's gradients and they never do."
        )
    else:
        console.print(f"(with --epochs {epochs} the backbone is never unfrozen, so neither run diverges)")
    console.print(f"reports: {out / runs[0][0]}  {out / runs[1][0]}")
    console.print(f"next: weightsync-audit show {out / runs[0][0]}   |   weightsync-audit check {out / runs[1][0]}")
    if not ok:
        console.print(Text("the runs did not behave as expected (see above)", style="bold red"))
    return 0 if ok else 1


def _rule(console: Console, title: str, style: str = "rule.line") -> RenderableType:
    """A rule across a terminal; off one (a log, a pipe) a short titled line, never 10,000 dashes."""
    if console.is_terminal:
        return Rule(title, style=style)
    return Text(f"--- {title} ---", style=style)


def _verdict(summary: ReportSummary) -> Text:
    first = summary.first_divergence
    if first is None:
        return Text(f"report: {len(summary.records)} audits, in sync throughout", style="bold green")
    _, r = first
    return Text(
        f"report: {len(summary.records)} audits, {len(summary.diverged)} diverged; first at step {fmt_step(r.step)} "
        f"(epoch {r.epoch}): {', '.join(r.diverged_names[:4])} on rank(s) {diverged_ranks(r.mismatches)}",
        style="bold red",
    )
