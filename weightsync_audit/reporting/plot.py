"""A picture of a run: tensors (or layers) against audits, coloured by in sync / diverged and gap size;
below it, max |diff| per layer over steps on a log scale (drift that grows and a jump that appears at
once look different); the step a divergence was pinpointed to is marked on both.

Needs matplotlib, the ``plot`` extra (``pip install matplotlib``, or ``pip install -e '.[plot]'`` in a
checkout); everything else in the
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
from typing import Any, Sequence

from weightsync_audit.reporting.record import AuditResult
from weightsync_audit.text import layer_of

__all__ = ["PLOT_EXTRA_MISSING", "PlotUnavailableError", "plot_report"]

PLOT_EXTRA_MISSING = (
    "drawing a plot needs matplotlib, which is not installed: pip install matplotlib "
    "(the plot extra; in a checkout: pip install -e '.[plot]')"
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
    Green: in sync; red, darker for a larger max |diff|: diverged; grey: diverged, size unknown;
    yellow edge: every difference within the run's tolerance. When gaps were measured, a second panel
    draws max |diff| per layer against the step (log scale). A pinpointed ``first_diverged_step`` is a
    dashed line on both.
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
    norm = LogNorm(*color_range(gaps))
    cmap = matplotlib.colormaps["Reds"]

    def red(v: float) -> tuple[float, float, float, float]:
        return tuple(cmap(0.35 + 0.65 * float(norm(min(max(v, norm.vmin), norm.vmax)))))  # type: ignore[return-value]

    labels = ["whole model", *names]
    image = _image(records, cells, names, red)
    height = 1.6 + 0.32 * len(labels)
    series = _gap_series(records)
    width = max(7.0, min(16.0, 4 + len(records) * 0.06))
    fig = Figure(figsize=(width, height + (3.2 if series else 0.0)), layout="constrained")
    if series:
        ax, gap_ax = fig.subplots(2, 1, height_ratios=[height, 3.2])
    else:
        ax, gap_ax = fig.add_subplot(), None
    pinned = next((r for r in records if r.first_diverged_step is not None), None)
    _draw_grid(ax, records, image, labels, pinned)
    if gap_ax is not None:
        _draw_gaps(gap_ax, series, pinned, [r.step for r in records if r.in_sync and r.step is not None])
    title = _title(records, pinned) if title is None else title
    if hidden:
        title += f"; {hidden} more {by}s not drawn"
    fig.suptitle(title, fontsize=10)
    legend = [Patch(color=_GREEN, label="in sync"), Patch(color=red(norm.vmax), label="diverged")]
    if any(c == _GREY for row in image for c in row):
        legend.append(Patch(color=_GREY, label="diverged, gap unknown"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if gaps:
        _colorbar(fig, ax, norm, cmap)
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out


MIN_DECADES = 1.0
"""The colour scale spans at least this many decades of max |diff|: gaps that all sit near one value
(9.996e-5 .. 1e-4) get one colour, not a fade from dark to light red."""


def color_range(gaps: Sequence[float]) -> tuple[float, float]:
    """``(vmin, vmax)`` of the colour scale: the measured gaps, widened around their geometric middle to
    at least :data:`MIN_DECADES` decades.

    >>> lo, hi = color_range([9.996e-5, 1e-4])
    >>> round(math.log10(hi / lo), 6), lo < 9.996e-5 and hi > 1e-4
    (1.0, True)
    """
    if not gaps:
        return 1e-8, 1.0
    lo, hi = min(gaps), max(gaps)
    if math.log10(hi / lo) < MIN_DECADES:
        mid = math.sqrt(lo * hi)
        half = 10 ** (MIN_DECADES / 2)
        lo, hi = mid / half, mid * half
    return lo, hi


def _image(records: Sequence[AuditResult], cells: list[dict[str, float | None]], names: list[str], red: Any) -> list:
    """The grid's colours: a row for the whole model, then one per name; a column per audit."""
    whole = []
    for r, col in zip(records, cells):
        if r.in_sync:
            whole.append(_GREEN)
        else:
            known = [v for v in col.values() if v is not None and v > 0]
            whole.append(red(max(known)) if known else _GREY)
    image = [whole]
    for name in names:
        row = []
        for col in cells:
            if name in col:
                v = col[name]
                row.append(red(v) if v is not None and v > 0 else _GREY)
            else:
                row.append(_GREEN)
        image.append(row)
    return image


def _draw_grid(ax: Any, records: Sequence[AuditResult], image: list, labels: list[str], pinned: Any) -> None:
    n_audits = len(records)
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
    if pinned is not None:
        step = pinned.first_diverged_step
        at = next((i for i, r in enumerate(records) if r.step is not None and r.step >= step), n_audits)
        ax.axvline(at - 0.5, color="black", linestyle="--", linewidth=1.2)
    for i, r in enumerate(records):
        if r.within_tolerance:
            ax.add_patch(_within_box(i))


def _title(records: Sequence[AuditResult], pinned: AuditResult | None) -> str:
    diverged = sum(not r.in_sync for r in records)
    first = next((r for r in records if not r.in_sync), None)
    title = f"weightsync audit: {len(records)} audits, {diverged} diverged"
    if first is not None:
        title += f"; first at step {'-' if first.step is None else first.step}"
        title += f" (epoch {first.epoch})" if first.epoch is not None else ""
    if pinned is not None:
        title += f"; began at step {pinned.first_diverged_step} ({pinned.pinpoint})"
    return title


def _colorbar(fig: Any, ax: Any, norm: Any, cmap: Any) -> None:
    """The max |diff| scale: labelled at whole decades only (1e-05, 1e-04), no crowded minor labels."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.ticker import LogFormatterSciNotation, LogLocator, NullFormatter

    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, fraction=0.04, pad=0.02)
    bar.set_label("max |diff|", fontsize=8)
    bar.ax.yaxis.set_major_locator(LogLocator(base=10, numticks=6))
    bar.ax.yaxis.set_major_formatter(LogFormatterSciNotation(base=10))
    bar.ax.yaxis.set_minor_formatter(NullFormatter())
    bar.ax.tick_params(labelsize=7)


def _gap_series(records: Sequence[AuditResult]) -> dict[str, list[tuple[int, float]]]:
    """Per layer, ``(step, max |diff|)`` at every audit that measured a positive gap for it."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r, col in zip(records, _rows(records, "layer")[1]):
        for key, gap in col.items():
            if r.step is not None and gap is not None and 0 < gap < math.inf:
                series.setdefault(key, []).append((r.step, gap))
    return series


def _draw_gaps(
    ax: Any, series: dict[str, list[tuple[int, float]]], pinned: AuditResult | None, in_sync_steps: list[int]
) -> None:
    for name, points in list(series.items())[:12]:
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1, label=name)
    if in_sync_steps:  # no gap to draw on a log scale: a tick along the bottom
        ax.scatter(
            in_sync_steps,
            [0.03] * len(in_sync_steps),
            transform=ax.get_xaxis_transform(),
            marker="|",
            s=60,
            color=_GREEN,
            label="audit in sync",
        )
    ax.set_yscale("log")
    ax.set_ylim(*color_range([y for points in series.values() for _, y in points]))  # a decade at least
    from matplotlib.ticker import NullFormatter

    ax.yaxis.set_minor_formatter(NullFormatter())  # whole decades labelled, never 9.9965e-5
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("max |diff|", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, which="major", linewidth=0.3)
    xs = [x for points in series.values() for x, _ in points] + in_sync_steps
    if pinned is not None and pinned.first_diverged_step is not None:
        xs.append(pinned.first_diverged_step)
    lo, hi = min(xs), max(xs)
    pad = max(1.0, (hi - lo) * 0.03)
    ax.set_xlim(lo - pad, hi + pad)
    if pinned is not None:
        step = pinned.first_diverged_step
        ax.axvline(step, color="black", linestyle="--", linewidth=1.2)
        ax.text(step, 0.97, f" diverged at step {step}", transform=ax.get_xaxis_transform(), fontsize=7, va="top")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False, title="layer", title_fontsize=7)


def _within_box(i: int) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((i - 0.5, -0.5), 1, 1, fill=False, edgecolor=(0.95, 0.75, 0.1), linewidth=1.5)
