"""How a result looks in a terminal: rich renderables, never prints inside the engine.

It draws anything shaped like a record (the protocols below), so the record can draw itself through it
(``console.print(result)``) without the two modules importing each other.
"""

from __future__ import annotations

import sys
from typing import IO, Iterator, Protocol, Sequence

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from weightsync_audit.text import blame_line, fmt_gap, fmt_ranks, fmt_shard, is_tie, last_in_sync, layer_of, without_tie

__all__ = ["MismatchLike", "ResultLike", "log_console", "mismatch_table", "render", "render_group", "render_result"]

_NO_WRAP_WIDTH = 10_000
"""Console width off a terminal: wide enough that no verdict, table row or hint is ever wrapped."""


def log_console(file: IO[str] | None = None) -> Console:
    """A console for reports: as usual on a terminal; elsewhere (CI logs, pipes, files) one line per
    verdict, never wrapped at 80 columns, so a log line can be grepped whole.

    >>> import io
    >>> log_console(io.StringIO()).width
    10000
    """
    file = file if file is not None else sys.stdout
    console = Console(file=file)
    if console.is_terminal:
        return console
    return Console(file=file, soft_wrap=True, width=_NO_WRAP_WIDTH)


class MismatchLike(Protocol):
    """What a table row shows of a :class:`~weightsync_audit.Mismatch`."""

    name: str
    kind: str
    ranks: list[int]
    reference_ranks: list[int]
    shape: list[int] | None
    dtype: str | None
    max_abs_diff: float | None
    detail: str | None
    shard: dict[str, int] | None


class ResultLike(Protocol):
    """What the rendering shows of an :class:`~weightsync_audit.AuditResult`."""

    in_sync: bool
    last_in_sync_step: int | None
    last_full_sync_step: int | None
    coverage: str | None
    hints: list[str]
    notes: list[str]

    @property
    def mismatches(self) -> Sequence[MismatchLike]: ...

    def summary(self, *, tie: bool = True) -> str: ...


def _fmt_rel(m: MismatchLike) -> str:
    # Optional on a row (a checkpoint diff has no relative gap): read when present.
    rel = getattr(m, "rel_diff", None)
    text = "" if rel is None else f" (rel {rel:.2g})"
    count = getattr(m, "diff_count", None)
    if count is not None:
        text += f", {count:,} element{'s' if count != 1 else ''}"
    return text + (" within tol." if getattr(m, "within_tolerance", None) else "")


MAX_TABLE_ROWS = 20
"""Rows a printed table of mismatches shows; the rest are counted below it (the record holds them all)."""

#: What a "-" means in each column of :func:`mismatch_table`, said below the table when one is shown.
DASH_MEANS = {
    "shape": "shape/dtype -: not the same on every rank or missing on some (a structure mismatch)",
    "gap": "max |diff| -: not measured (an audit measures at most max_diff_tensors tensors, 8 by default; "
    "a structure mismatch or a rank too late for the transfer has none; the tensor's note says which)",
}


def mismatch_table(mismatches: Sequence[MismatchLike], title: str | None = None) -> Table:
    """A table of mismatches grouped by layer: at most :data:`MAX_TABLE_ROWS` rows, then "and N more"; a
    caption says what each "-" shown means."""
    table = Table(title=title, show_lines=False, header_style="bold", caption_justify="left")
    for col, kw in (
        ("layer", {"style": "cyan"}),
        ("tensor", {}),
        ("kind", {}),
        ("shape", {}),
        ("dtype", {}),
        ("ranks", {"style": "red"}),
        ("reference", {"style": "green"}),
        ("max |diff|", {"justify": "right"}),
    ):
        table.add_column(col, **kw)
    by_layer: dict[str, list[MismatchLike]] = {}
    dashes: dict[str, None] = {}
    for m in mismatches[:MAX_TABLE_ROWS]:
        by_layer.setdefault(layer_of(m.name, m.kind), []).append(m)
    for layer, ms in by_layer.items():
        for i, m in enumerate(ms):
            short = m.name[len(layer) + 1 :] if m.name.startswith(layer + ".") else m.name
            table.add_row(
                escape(layer) if i == 0 else "",
                # Names and details are data: escaped, so a name like "w[red]" is shown, never styled.
                escape(short)
                + (f" [magenta]\\[shard {escape(fmt_shard(m.shard))}][/magenta]" if m.shard else "")
                + (f"  [dim]({escape(detail)})[/dim]" if (detail := without_tie(m.detail)) else ""),
                m.kind,
                "-" if m.shape is None else "x".join(map(str, m.shape)) or "scalar",
                m.dtype or "-",
                ",".join(map(str, m.ranks)),
                ",".join(map(str, m.reference_ranks)),
                fmt_gap(m.max_abs_diff) + _fmt_rel(m),
            )
            if m.shape is None or not m.dtype:
                dashes.setdefault("shape", None)
            if m.max_abs_diff is None:
                dashes.setdefault("gap", None)
        table.add_section()
    notes = [DASH_MEANS[k] for k in dashes]
    if (more := len(mismatches) - MAX_TABLE_ROWS) > 0:
        notes.insert(0, f"... and {more} more tensor(s) (the report's record lists them all)")
    if notes:
        table.caption = "\n".join(notes)
    return table


def render_result(result: ResultLike) -> Iterator[RenderableType]:
    style = "bold green" if result.in_sync else "bold red"
    # The headline carries the pinpointed step; a tie is said once, on its own line below.
    yield Text("weightsync audit: " + result.summary(tie=False), style=style)
    if result.last_in_sync_step is not None and not result.in_sync:
        yield Text(last_in_sync(result.step, result.last_in_sync_step), style="dim")
    ties = [m for m in result.mismatches if is_tie(m.detail)]
    if ties:
        sides = sorted({r for m in ties for r in m.reference_ranks}), sorted({r for m in ties for r in m.ranks})
        yield Text(
            f"tie: {len(ties)} tensor(s) split {fmt_ranks(sides[0])} vs {fmt_ranks(sides[1])} in equal numbers; "
            "no majority, so the side called the reference may be the diverged one",
            style="bold yellow",
        )
    if result.coverage:
        full = result.last_full_sync_step
        yield Text(
            f"sampled: this audit read {result.coverage} of each large tensor; last full verification in sync: "
            + ("never" if full is None else f"step {full}"),
            style="yellow",
        )
    if result.mismatches:
        yield mismatch_table(result.mismatches)
    blame = getattr(result, "blame", None)  # a record read back from an older report has none
    if blame is not None:
        yield Text(blame_line(blame), style="bold")
    for hint in result.hints:
        yield Text("hint: " + hint, style="yellow")
    for note in result.notes:
        yield Text("note: " + note, style="dim")


def render_group(result: ResultLike) -> Group:
    return Group(*render_result(result))


def render(result: ResultLike, file: IO[str] | None = None) -> None:
    """Print ``result`` as the callbacks print it: the verdict, the table of diverged tensors, the hints.

    On a terminal it is styled; anywhere else (a CI log, a file) one line per fact, never wrapped.

    >>> import io
    >>> from weightsync_audit import AuditResult, render
    >>> out = io.StringIO()
    >>> render(AuditResult(in_sync=True, step=3), file=out)
    >>> out.getvalue().splitlines()[0]
    'weightsync audit: step 3: in sync across 1 rank(s), 0 tensors checked'
    """
    log_console(file).print(render_group(result))
