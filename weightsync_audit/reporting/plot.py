"""A picture of a run: tensors (or layers) against audits, coloured by in sync / diverged and gap size.

Needs matplotlib, the ``plot`` extra (``pip install 'weightsync-audit[plot]'``); everything else in the
library works without it. No pyplot, no GUI backend: the figure is drawn straight to a file.

>>> import os, tempfile
>>> from weightsync_audit import AuditResult, Mismatch
>>> records = [AuditResult(in_sync=True, step=1),
...            AuditResult(in_sync=False, step=2, mismatches=[Mismatch("fc.weight", "param", [1], [0], max_abs_diff=0.01)])]
>>> path = plot_report(records, os.path.join(tempfile.mkdtemp(), "run.png"))
>>> os.path.getsize(path) > 0
True
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

from weightsync_audit.reporting.record import AuditResult
from weightsync_audit.text import layer_of

__all__ = ["PLOT_EXTRA_MISSING", "PlotUnavailableError", "plot_report"]

PLOT_EXTRA_MISSING = (
    "drawing a plot needs matplotlib, which is not installed: pip install 'weightsync-audit[plot]' "
    "(or pip install matplotlib)"
)

_GREEN = (0.30, 0.69, 0.31, 1.0)
_GREY = (0.55, 0.55, 0.62, 1.0)


class PlotUnavailableError(ImportError):
    """matplotlib (the ``plot`` extra) is missing."""


def _rows(records: Sequence[AuditResult], by: str) -> tuple[list[str], list[dict[str, float | None]]]:
    """Row labels (first diverged first) and, per audit, row -> max |diff| (None: diverged, gap unknown)."""
    order: dict[str, None] = {}
    cells: list[dict[str, float | None]] = []
    for r in records:
        col: dict[str, float | None] = {}
        for m in r.mismatches:
            key = layer_of(m.name, m.kind) if by == "layer" else m.name
            order.setdefault(key, None)
            gap = m.max_abs_diff
            if key not in col:
                col[key] = gap
            elif gap is not None and (col[key] is None or gap > col[key]):  # type: ignore[operator]
                col[key] = gap
        cells.append(col)
    return list(order), cells


def plot_report(
    records: Sequence[AuditResult],
    path: str | os.PathLike[str],
    *,
    by: str = "tensor",
    title: str | None = None,
    max_rows: int = 40,
) -> Path:
    """Draw ``records`` (in file order) to ``path`` (PNG, SVG or PDF by its ending); return the path.

    Rows: one for the whole model (every audit), then one per tensor (``by="tensor"``) or per layer
    (``by="layer"``) that ever diverged, at most ``max_rows``. Columns: audits, labelled by step.
    Green: in sync; red, darker for a larger max |diff|: diverged; grey: diverged, size unknown.
    """
    if by not in ("tensor", "layer"):
        raise ValueError(f"by={by!r}: choose 'tensor' or 'layer'")
    if not records:
        raise ValueError("no audit records to plot")
    try:
        import matplotlib
        from matplotlib.colors import LogNorm
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise PlotUnavailableError(PLOT_EXTRA_MISSING) from None

    names, cells = _rows(records, by)
    hidden = max(0, len(names) - max_rows)
    names = names[:max_rows]
    gaps = [v for col in cells for v in col.values() if v is not None and v > 0 and math.isfinite(v)]
    lo = min(gaps) if gaps else 1e-8
    hi = max(gaps) if gaps else 1.0
    if hi <= lo:
        lo, hi = lo / 10, hi * 10
    norm = LogNorm(vmin=lo, vmax=hi)
    cmap = matplotlib.colormaps["Reds"]

    def red(v: float) -> tuple[float, float, float, float]:
        return tuple(cmap(0.35 + 0.65 * float(norm(max(v, lo)))))  # type: ignore[return-value]

    labels = ["whole model", *names]
    n_audits = len(records)
    image = []
    whole = []
    for r, col in zip(records, cells):
        if r.in_sync:
            whole.append(_GREEN)
        else:
            known = [v for v in col.values() if v is not None and v > 0]
            whole.append(red(max(known)) if known else _GREY)
    image.append(whole)
    for name in names:
        row = []
        for col in cells:
            if name in col:
                v = col[name]
                row.append(red(v) if v is not None and v > 0 else _GREY)
            else:
                row.append(_GREEN)
        image.append(row)

    height = 1.6 + 0.32 * len(labels)
    fig = Figure(figsize=(max(7.0, min(16.0, 4 + n_audits * 0.06)), height), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(image, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(labels)), labels=labels, fontsize=8)
    every = max(1, n_audits // 12)
    ticks = list(range(0, n_audits, every))
    if n_audits - 1 - ticks[-1] > every // 2:
        ticks.append(n_audits - 1)
    ax.set_xticks(
        ticks, labels=[str(records[i].step) if records[i].step is not None else "-" for i in ticks], fontsize=8
    )
    ax.set_xlabel("audit (labelled by optimizer step)")
    ax.axhline(0.5, color="black", linewidth=0.8)
    for i in range(1, n_audits):
        e0, e1 = records[i - 1].epoch, records[i].epoch
        if e0 is not None and e1 is not None and e1 != e0:
            ax.axvline(i - 0.5, color="black", linestyle=":", linewidth=0.8)
            ax.text(i - 0.4, -0.6, f"epoch {e1}", fontsize=7, va="bottom")
    if title is None:
        diverged = sum(not r.in_sync for r in records)
        first = next((r for r in records if not r.in_sync), None)
        title = f"weightsync audit: {n_audits} audits, {diverged} diverged"
        if first is not None:
            title += f"; first at step {first.step}" + (f" (epoch {first.epoch})" if first.epoch is not None else "")
    if hidden:
        title += f"; {hidden} more {by}s not drawn"
    ax.set_title(title, fontsize=10, pad=14)
    legend = [Patch(color=_GREEN, label="in sync"), Patch(color=red(hi), label="diverged")]
    if any(c == _GREY for row in image for c in row):
        legend.append(Patch(color=_GREY, label="diverged, gap unknown"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if gaps:
        from matplotlib.cm import ScalarMappable

        sm = ScalarMappable(norm=norm, cmap=cmap)
        bar = fig.colorbar(sm, ax=ax, fraction=0.04, pad=0.02)
        bar.set_label("max |diff|", fontsize=8)
        bar.ax.tick_params(labelsize=7)
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out
