"""``diff``: two checkpoints tensor by tensor."""

from __future__ import annotations

import json
from typing import Sequence

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from weightsync_audit.cli._summary import EXIT_DIFFERENT, EXIT_OK, CliError, fmt_gap
from weightsync_audit.cli._verify import sidecar_diff
from weightsync_audit.cli.checkpoint_diff import CheckpointError, diff_checkpoints
from weightsync_audit.reporting.render import log_console

_STYLE = {"missing": "red", "extra": "blue", "shape": "magenta", "dtype": "magenta", "values": "yellow"}


def cmd_diff(
    a: str,
    b: str | None,
    *,
    atol: float | None = None,
    exclude: Sequence[str] = (),
    limit: int = 50,
    as_json: bool = False,
    console: Console | None = None,
    sidecars: bool = False,
) -> int:
    """Compare checkpoints; 0 identical, 1 different, 2 unreadable or refused. With ``sidecars``, two
    checkpoints that both have a weightsync sidecar are compared by their digests, without loading them."""
    if sidecars and b is not None:
        code = sidecar_diff(a, b, console or Console(soft_wrap=True), as_json)
        if code is not None:
            return code
    try:
        result = diff_checkpoints(a, b, atol=atol, exclude=exclude)
    except CheckpointError as exc:
        raise CliError(str(exc)) from None
    console = console or log_console()
    code = EXIT_OK if result.identical else EXIT_DIFFERENT
    if as_json:
        console.file.write(json.dumps(result.to_dict(), indent=2) + "\n")
        return code
    for pair in result.pairs:
        title = f"{pair.a or '(none)'}  vs  {pair.b or '(none)'}"
        if pair.a is None or pair.b is None:
            console.print(Text(f"{title}: {pair.note}", style="bold red"))
            continue
        if pair.note:
            console.print(Text(pair.note, style="dim"))
        if pair.exact:
            console.print(Text(f"IDENTICAL: {title}: all {pair.compared} entries equal", style="bold green"))
            continue
        if pair.identical:
            worst = max(e.max_abs_diff or 0.0 for e in pair.within_atol)
            console.print(
                Text(
                    f"EQUAL within atol {atol:g}: {title}: {len(pair.within_atol)} of {pair.compared} entries differ, "
                    f"all within atol (largest max |diff| {fmt_gap(worst)}); the others have equal bits",
                    style="bold green",
                )
            )
            continue
        counts: dict[str, int] = {}
        for e in pair.entries:
            counts[e.status] = counts.get(e.status, 0) + 1
        said = ", ".join(f"{n} {s}" for s, n in counts.items())
        console.print(
            Text(f"DIFFERENT: {title}: {said}; {pair.same} of {pair.compared} shared entries equal", style="bold red")
        )
        table = Table(header_style="bold", box=box.SIMPLE_HEAD)
        widest = max(len(e.name) for e in pair.entries[:limit]) if pair.entries[:limit] else 4
        for col, kw in (
            ("name", {"style": "cyan", "overflow": "fold", "min_width": min(40, widest)}),
            ("what", {}),
            ("A", {}),
            ("B", {}),
            ("max |diff|", {"justify": "right"}),
            ("changed", {"justify": "right"}),
        ):
            table.add_column(col, **kw)
        for e in pair.entries[:limit]:
            changed = "-" if e.changed is None else f"{e.changed}/{e.numel}"
            table.add_row(
                escape(e.name),
                Text(e.status, style=_STYLE[e.status]),
                escape(e.a or "-"),
                escape(e.b or "-"),
                fmt_gap(e.max_abs_diff),
                changed,
            )
        console.print(table)
        if len(pair.entries) > limit:
            console.print(Text(f"... and {len(pair.entries) - limit} more (--limit N, or --json for all)", style="dim"))
    return code
