"""A report in the terminal: summarised for CI (``check``), laid out for a person (``show``,
:func:`print_report`)."""

from __future__ import annotations

import json
from typing import IO, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from weightsync_audit.errors import ReportReadError
from weightsync_audit.reporting.record import AuditResult
from weightsync_audit.reporting.render import log_console
from weightsync_audit.reporting.summary import (
    EXIT_ERROR,
    EXIT_OK,
    ReportSummary,
    diverged_ranks,
    fmt_step,
    pinpoint_line,
)
from weightsync_audit.text import COMPARED_NOTES, blame_line, brief_names, fmt_gap, fmt_ranks, fmt_shard, without_tie

#: Rows of a printed table (timeline stretches, layers); the rest are counted below it.
MAX_ROWS = 30

#: Invalid lines named one by one; the rest are counted (``--json`` lists them all).
MAX_ERROR_LINES = 10


def _errors(console: Console, summary: ReportSummary) -> None:
    for e in summary.errors[:MAX_ERROR_LINES]:
        forgiven = summary.allow_torn and e.torn
        style = "yellow" if forgiven else "bold red"
        label = "warning" if forgiven else "invalid"
        console.print(Text(f"{label}: {summary.path}: {e}", style=style))
    if len(summary.errors) > MAX_ERROR_LINES:
        more = len(summary.errors) - MAX_ERROR_LINES
        console.print(Text(f"... and {more} more invalid line(s) (--json lists them all)", style="bold red"))
    if summary.status == "invalid":
        torn_only = all(e.torn for e in summary.blocking_errors)
        extra = " (pass --allow-torn to skip torn lines, left by a crash mid-write)" if torn_only else ""
        console.print(Text(f"{summary.path} is not a valid report: exit 2{extra}", style="bold red"))


def _divergence_lines(r: AuditResult, line: int) -> list[Text]:
    where = f"step {fmt_step(r.step)}" + (
        f" (epoch {r.epoch}" + (f", {r.hook})" if r.hook else ")") if r.epoch is not None else ""
    )
    out = [Text.assemble(("first divergence: ", "bold"), (where, "bold red"), f", report line {line}")]
    if r.in_sync and r.transient:
        t = r.transient
        span = "steps the ring no longer held"
        if t.get("first_diverged_step") is not None:
            span = f"steps {t['first_diverged_step']} .. {t['last_diverged_step']}"
        names = brief_names(t.get("names") or ["(not named)"], 8)
        out.append(Text(f"  transient: the replicas differed at {span} ({names}) and agree again at this audit"))
        return out
    parts = []
    for m in r.mismatches[:8]:
        extra = [m.kind] + ([f"shard {fmt_shard(m.shard)}"] if m.shard else [])
        if m.max_abs_diff is not None:
            extra.append(f"max |diff| {fmt_gap(m.max_abs_diff)}")
        if m.rel_diff is not None:
            extra.append(f"rel {fmt_gap(m.rel_diff)}")
        if m.diff_count is not None:
            extra.append(f"{m.diff_count:,} element(s) differ")
        if m.within_tolerance:
            extra.append("within tolerance")
        detail = without_tie(m.detail)  # a tie is said once, on the TIE line below
        if detail:
            extra.append(detail)
        parts.append(f"{m.name} ({', '.join(extra)})")
    more = len(r.mismatches) - 8
    out.append(Text("  tensors: " + ", ".join(parts) + (f" and {more} more" if more > 0 else "")))
    refs = sorted({x for m in r.mismatches for x in m.reference_ranks})
    out.append(Text(f"  ranks: {diverged_ranks(r.mismatches)} differ from the reference held by {refs}"))
    out.extend(Text(f"  rank {rank} runs on {where}") for rank, where in (r.hosts or {}).items())
    if r.blame is not None:
        out.append(Text("  " + blame_line(r.blame), style="bold"))
    ties = [m for m in r.mismatches if m.tie]
    if ties:
        sides = sorted({x for m in ties for x in m.reference_ranks}), diverged_ranks(ties)
        out.append(
            Text(
                f"  TIE: {brief_names([m.name for m in ties], 4)}: {fmt_ranks(sides[0])} vs {fmt_ranks(sides[1])} "
                "in equal numbers, no majority: the side called the reference may be the diverged one",
                style="bold yellow",
            )
        )
    began = pinpoint_line(r)
    if began is not None:
        out.append(Text("  " + began, style="bold"))
    if r.last_in_sync_step is not None:
        out.append(Text(f"  last in sync: step {r.last_in_sync_step}"))
    for h in r.hints:
        out.append(Text("  hint: " + h, style="yellow"))
    return out


def check_report(
    path: str,
    *,
    as_json: bool = False,
    allow_torn: bool = False,
    accept_repaired: bool = False,
    console: Console | None = None,
) -> int:
    """Summarise a report as ``weightsync-audit check`` does; returns its exit code: 0 all in sync (or
    repaired, with ``accept_repaired``), 1 any divergence, 2 invalid, empty or nothing compared (no audit
    compared a tensor between ranks: no verdict). :class:`ReportReadError` when
    the file cannot be read at all."""
    summary = ReportSummary.read(path, allow_torn, accept_repaired)
    console = console or log_console()
    if as_json:
        console.file.write(json.dumps(summary.to_json(), indent=2) + "\n")
        return summary.exit_code
    console.print(Text(summary.headline(), style="bold"))
    rs = summary.results
    if summary.status == "empty":
        console.print(
            Text("no audit records: the run did not audit (or wrote its report elsewhere): exit 2", style="bold red")
        )
    elif summary.status == "nothing_compared":
        console.print(
            Text(
                f"NOTHING COMPARED: none of the {len(rs)} audit(s) compared a tensor between ranks (nothing to "
                "audit, or nothing with a replica: see the notes), so none says the replicas agree: exit 2",
                style="bold red",
            )
        )
    elif not summary.diverged and rs:
        _print_in_sync(console, summary)
    elif rs:
        _print_diverged(console, summary)
    for note in dict.fromkeys(n for r in rs for n in r.notes if any(c in n for c in COMPARED_NOTES)):
        console.print(Text("note: " + note, style="yellow"))
    for f in summary.checkpoint_failures:  # the CI guard reads every verdict: a checkpoint or resume that failed
        where = f"{f['path']} ({f['event']} at step {f['step']}, line {f['line']})"
        console.print(Text(f"CHECKPOINT FAILED: {where}: " + "; ".join(f["why"]), style="bold red"))
    _errors(console, summary)
    return summary.exit_code


def _print_in_sync(console: Console, summary: ReportSummary) -> None:
    """``check``'s verdict for a run whose audits all agreed (within tolerance, or as far as sampled)."""
    rs = summary.results
    valid = " valid" if summary.errors else ""
    sampled = [r for r in rs if r.sampled]
    within = len(summary.within_tolerance)
    if within:
        console.print(
            Text(
                f"IN SYNC WITHIN TOLERANCE: {within} of {len(rs)}{valid} audit(s) found differences, every one "
                f"within the run's tolerance (largest rel_diff {fmt_gap(_worst_rel(summary))})",
                style="bold green",
            )
        )
    elif not sampled:
        empty = len(summary.compared_nothing)  # no verdict of their own: counted apart
        which = " that compared tensors" if empty else ""
        apart = f" ({empty} more compared nothing: see the notes)" if empty else ""
        console.print(
            Text(
                f"IN SYNC: all {len(rs) - empty}{valid} audit(s){which} found every rank holding the same weights{apart}",
                style="bold green",
            )
        )
    else:
        shares = "/".join(sorted({f"1/{r.coverage.split('/')[1]}" for r in sampled if r.coverage}))
        full = rs[-1].last_full_sync_step
        console.print(
            Text(
                f"IN SYNC as far as read: all {len(rs)}{valid} audit(s) agreed, but {len(sampled)} of them were "
                f"sampled and read {shares} of each large tensor; last full verification in sync: "
                + ("never" if full is None else f"step {full}"),
                style="bold green",
            )
        )


def _print_diverged(console: Console, summary: ReportSummary) -> None:
    """``check``'s verdict for a run with a divergence: the first one, resyncs, and the state at the end."""
    rs = summary.results
    if summary.status == "repaired":
        verdict = Text(
            f"REPAIRED: {len(summary.diverged)} of {len(rs)} audit(s) found replicas out of sync, each repaired "
            "by resync; in sync at the end (accepted: --accept-repaired): exit 0",
            style="bold yellow",
        )
    else:
        verdict = Text(
            f"DIVERGED: {len(summary.diverged)} of {len(rs)} audit(s) found replicas out of sync", style="bold red"
        )
    console.print(verdict)
    first = summary.first_divergence
    assert first is not None
    for t in _divergence_lines(first[1], first[0]):
        console.print(t)
    last = rs[-1]
    resynced = sum(r.action == "resynced" for r in rs)
    if resynced:
        console.print(f"resynced: {resynced} audit(s) repaired the replicas from a healthy rank")
    state = "in sync" if last.in_sync else f"still diverged ({len(last.mismatches)} tensor(s))"
    if not last.in_sync and last.action == "resynced":
        state = "in sync (after its resync)"
    console.print(f"at the end (step {fmt_step(last.step)}): {state}")
    if summary.repaired and not summary.accept_repaired:
        console.print(
            Text("every divergence was repaired by resync and the run ended in sync: pass --accept-repaired to exit 0")
        )
    recurred = summary.recurred
    if recurred:
        accepted = " (--accept-repaired does not accept it)" if summary.accept_repaired else ""
        console.print(
            Text(
                f"NOT REPAIRED: a cause came back after its repair, {len(recurred)} time(s); first at "
                f"{recurred[0].said()}: a resync does not remove it, so the run is not repaired{accepted}: exit 1",
                style="bold red",
            )
        )


#: Timeline characters, distinct without colour: in sync, in sync on a sample only, within the tolerance, diverged.
STRIP_CHARS = {"in_sync": "=", "sampled": "~", "within": "-", "diverged": "X"}


def _worst_rel(summary: ReportSummary) -> float | None:
    rels = [m.rel_diff for _, r in summary.within_tolerance for m in r.mismatches if m.rel_diff is not None]
    return max(rels) if rels else None


def _strip(summary: ReportSummary, width: int) -> Text:
    """One character per audit (or per bucket of audits): ``=`` in sync, ``~`` sampled, ``-`` within tolerance, ``X`` diverged."""
    rs = summary.results
    n = len(rs)
    buckets = min(n, max(10, width))
    text = Text("timeline: ")
    for b in range(buckets):
        chunk = rs[b * n // buckets : (b + 1) * n // buckets] or [rs[min(n - 1, b * n // buckets)]]
        if any(not r.in_sync and not r.within_tolerance for r in chunk):
            text.append(STRIP_CHARS["diverged"], style="bold red")
        elif any(r.within_tolerance for r in chunk):
            text.append(STRIP_CHARS["within"], style="yellow")
        elif any(r.sampled for r in chunk):
            text.append(STRIP_CHARS["sampled"], style="yellow")
        else:
            text.append(STRIP_CHARS["in_sync"], style="green")
    first, last = rs[0].step, rs[-1].step
    text.append(
        f"  steps {fmt_step(first)} .. {fmt_step(last)}  (= in sync, ~ in sync on a sample, - within tolerance, X diverged)",
        style="dim",
    )
    return text


def _timeline_table(summary: ReportSummary) -> Table:
    table = Table(title="timeline", header_style="bold", title_justify="left", caption_justify="left")
    for col, kw in (
        ("steps", {"justify": "right"}),
        ("epochs", {"justify": "right"}),
        ("audits", {"justify": "right"}),
        ("state", {}),
        ("diverged tensors", {}),
        ("max |diff|", {"justify": "right"}),
    ):
        table.add_column(col, **kw)
    segments = summary.segments()
    for seg in segments[:MAX_ROWS]:
        if seg.in_sync:
            state = Text("in sync", style="green")
        elif seg.first.within_tolerance and seg.last.within_tolerance:
            state = Text("within tolerance", style="yellow")
        else:
            state = Text("DIVERGED", style="bold red")
        names = brief_names(seg.names, 6)
        table.add_row(seg.steps(), seg.epochs(), str(seg.audits), state, escape(names) or "-", fmt_gap(seg.max_gap))
    notes = []
    if len(segments) > MAX_ROWS:
        notes.append(f"... and {len(segments) - MAX_ROWS} more stretch(es) (check --json, or the report, has them all)")
    notes.append("-: in sync (no tensor differs), no epoch recorded, or max |diff| not measured")
    table.caption = "\n".join(notes)
    return table


def _layer_table(summary: ReportSummary) -> Table | None:
    rows = summary.layers()
    if not rows:
        return None
    total = len(summary.results)
    table = Table(title="layers that diverged", header_style="bold", title_justify="left", caption_justify="left")
    for col, kw in (
        ("layer", {"style": "cyan"}),
        ("tensors", {}),
        ("first diverged", {}),
        ("audits", {"justify": "right"}),
        ("ranks", {}),
        ("worst |diff|", {"justify": "right"}),
        ("last |diff|", {"justify": "right"}),
    ):
        table.add_column(col, **kw)
    for row in rows[:MAX_ROWS]:
        first = row.first
        assert first is not None
        where = f"step {fmt_step(first.step)}" + (f", ep {first.epoch}" if first.epoch is not None else "")
        short = [n[len(row.layer) + 1 :] if n.startswith(row.layer + ".") else n for n in row.tensors]
        kinds = "" if list(row.kinds) == ["param"] else f" ({','.join(row.kinds)})"
        ranks = Text.assemble(
            (",".join(map(str, sorted(row.ranks))), "red"),
            " vs ",
            (",".join(map(str, sorted(row.reference_ranks))), "green"),
        )
        table.add_row(
            escape(row.layer),
            escape(", ".join(short[:6]) + (f" +{len(short) - 6}" if len(short) > 6 else "") + kinds),
            where,
            f"{row.audits}/{total}",
            ranks,
            fmt_gap(row.worst_gap),
            fmt_gap(row.last_gap),
        )
    notes = []
    if len(rows) > MAX_ROWS:
        notes.append(f"... and {len(rows) - MAX_ROWS} more layer(s)")
    if any(r.worst_gap is None or r.last_gap is None for r in rows[:MAX_ROWS]):
        notes.append(
            "-: max |diff| not measured (at most max_diff_tensors tensors an audit; none for a structure mismatch)"
        )
    table.caption = "\n".join(notes) or None
    return table


def show_summary(summary: ReportSummary, console: Console) -> int:
    """Lay a read report out as ``weightsync-audit show`` does; 0 shown, 2 invalid or empty."""
    console.print(Text(summary.headline(), style="bold"))
    if summary.records:
        console.print(_strip(summary, max(10, min(80, console.width - 30))))
        console.print(_timeline_table(summary))
        layers = _layer_table(summary)
        if layers is not None:
            console.print(layers)
        else:
            checked: dict[str, Any] = summary.results[-1].checked
            what = ", ".join(f"{n} {k}" for k, n in checked.items() if n)
            sampled = sum(r.sampled for r in summary.results)
            share = f"; {sampled} sampled audit(s) read a share of each large tensor only" if sampled else ""
            console.print(Text(f"every audit in sync ({what or 'nothing'} checked in the last{share})", style="green"))
        first = summary.first_divergence
        for rank, where in (first[1].hosts or {}).items() if first is not None else ():
            console.print(Text(f"rank {rank} (diverged) runs on {where}", style="red"))
        if first is not None and first[1].blame is not None:
            console.print(Text(blame_line(first[1].blame), style="bold red"))
        began = pinpoint_line(first[1]) if first is not None else None
        if began is not None:
            console.print(Text(f"divergence {began}", style="bold red"))
        for h in summary.hints():
            console.print(Text("hint: " + h, style="yellow"))
        notes = dict.fromkeys(n for r in summary.results for n in r.notes)
        for n in notes:
            console.print(Text("note: " + n, style="dim"))
    else:
        console.print(Text("no audit records", style="bold red"))
    _errors(console, summary)
    return EXIT_ERROR if summary.status in ("invalid", "empty") else EXIT_OK


def print_report(path: str, *, file: IO[str] | None = None, allow_torn: bool = False) -> int:
    """Print a JSONL report as ``weightsync-audit show`` does; returns its exit code (0 shown, 2 unreadable).

    Needs no torch: a report is read with ``json`` only.

    >>> import os, tempfile
    >>> from weightsync_audit import AuditResult, ReportWriter, print_report
    >>> path = os.path.join(tempfile.mkdtemp(), "audit.jsonl")
    >>> with ReportWriter(path) as w:
    ...     w.write(AuditResult(in_sync=True, step=1))
    >>> print_report(path, file=open(os.devnull, "w"))
    0
    """
    try:
        summary = ReportSummary.read(path, allow_torn)
    except ReportReadError as exc:
        log_console(file).print(Text(f"error: {exc}", style="bold red"))
        return EXIT_ERROR
    return show_summary(summary, log_console(file))
