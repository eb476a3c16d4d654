"""What a report says, in one object: the summary behind ``check``, ``show``, :func:`print_report` and the demo.

>>> summary = ReportSummary("audit.jsonl", [(1, AuditResult(in_sync=True, step=3))], [])
>>> summary.status, summary.exit_code, summary.headline()
('in_sync', 0, 'audit.jsonl: 1 audit(s), step 3, 1 rank(s)')
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from weightsync_audit.errors import ReportFormatError, ReportReadError
from weightsync_audit.reporting.jsonl import read_report
from weightsync_audit.reporting.record import AuditResult, Mismatch
from weightsync_audit.text import fmt_shard, layer_of

EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2
"""The verdict as an exit status: in sync (or repaired, when accepted), diverged, unreadable."""


@dataclass(slots=True)
class Segment:
    """Consecutive audits with the same state: in sync, or the same set of diverged tensors."""

    first: AuditResult
    last: AuditResult
    audits: int
    in_sync: bool
    names: tuple[str, ...]
    max_gap: float | None

    def steps(self) -> str:
        a, b = self.first.step, self.last.step
        return fmt_step(a) if a == b else f"{fmt_step(a)}-{fmt_step(b)}"

    def epochs(self) -> str:
        a, b = self.first.epoch, self.last.epoch
        if a is None:
            return "-"
        return str(a) if a == b else f"{a}-{b}"


@dataclass(slots=True)
class LayerRow:
    """One layer that diverged at least once."""

    layer: str
    tensors: dict[str, None] = field(default_factory=dict)
    kinds: dict[str, None] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)
    reference_ranks: set[int] = field(default_factory=set)
    first: AuditResult | None = None
    last: AuditResult | None = None
    audits: int = 0
    worst_gap: float | None = None
    last_gap: float | None = None


RECURRED_HINT = "diverged again after a resync"
"""The words of the engine's hint for a rank that diverged again after a resync repaired it."""


@dataclass(slots=True)
class Recurrence:
    """A divergence that came back after a resync repaired it (``check`` never accepts it as repaired)."""

    line: int
    record: AuditResult
    ranks: list[int]
    """Ranks that diverged again after a resync repaired them."""
    names: list[str]
    """Tensors that diverged again after a resync repaired them."""
    resynced_step: int | None
    """The step of the first resync that repaired them."""

    def said(self) -> str:
        """``step 9: rank 1 (w) diverged again after the resync at step 3 repaired it``."""
        who = ", ".join(f"rank {r}" for r in self.ranks) or "the same tensors"
        names = ", ".join(self.names[:3]) + (", ..." if len(self.names) > 3 else "")
        at = f"at step {self.resynced_step}" if self.resynced_step is not None else "earlier"
        return f"step {fmt_step(self.record.step)}: {who}{f' ({names})' if names else ''} diverged again after the resync {at} repaired it"

    def to_dict(self) -> dict[str, Any]:
        return {
            "line": self.line,
            "step": self.record.step,
            "ranks": self.ranks,
            "names": self.names,
            "resynced_step": self.resynced_step,
        }


@dataclass(slots=True)
class ReportSummary:
    """Everything ``check`` and ``show`` print about a report."""

    path: str
    records: list[tuple[int, AuditResult]]
    errors: list[ReportFormatError]
    allow_torn: bool = False
    accept_repaired: bool = False
    """Count a run whose every divergence ``resync`` repaired, and that ended in sync, as passing."""

    @classmethod
    def read(
        cls, path: str | os.PathLike[str], allow_torn: bool = False, accept_repaired: bool = False
    ) -> ReportSummary:
        """Read and summarise ``path``; :class:`ReportReadError` when the file cannot be read at all."""
        p = os.fspath(path)
        if os.path.isdir(p):
            raise ReportReadError(f"{p} is a folder; give the report file (a .jsonl written by report_path=...)")
        try:
            contents = read_report(p)
        except FileNotFoundError:
            raise ReportReadError(f"{p}: no such file") from None
        except OSError as exc:
            raise ReportReadError(f"{p}: cannot be read ({exc.strerror or exc})") from None
        if not contents.records and contents.errors:
            kind = _not_a_report(p)
            if kind is not None:
                raise ReportReadError(
                    f"{p}: not an audit report ({kind}); a report is the JSONL text written by report_path=..."
                )
        return cls(p, contents.records, contents.errors, allow_torn, accept_repaired)

    # -- derived facts -------------------------------------------------------------------------

    @property
    def results(self) -> list[AuditResult]:
        return [r for _, r in self.records]

    @property
    def blocking_errors(self) -> list[ReportFormatError]:
        """Invalid lines that make the report unreadable (torn lines, anywhere, are forgiven with allow_torn)."""
        if self.allow_torn:
            return [e for e in self.errors if not e.torn]
        return list(self.errors)

    @property
    def diverged(self) -> list[tuple[int, AuditResult]]:
        """Audits that found replicas apart beyond the run's tolerance (any difference without one), or in
        sync again after a transient divergence since the audit before (``transient``). A transient span
        that ends at or before the previous audit's step repeats what that audit covered (a report written
        before the engine trimmed its rings after every audit): not counted twice."""
        out, prev = [], None
        for i, r in self.records:
            if (not r.in_sync and not r.within_tolerance) or (r.transient and not _repeated(r, prev)):
                out.append((i, r))
            prev = r
        return out

    @property
    def within_tolerance(self) -> list[tuple[int, AuditResult]]:
        """Audits whose every difference was within the run's ``tolerance`` (kept, not acted on)."""
        return [(i, r) for i, r in self.records if r.within_tolerance]

    @property
    def compared_nothing(self) -> list[tuple[int, AuditResult]]:
        """Audits that compared no tensor between ranks: they found no difference and prove no agreement."""
        return [(i, r) for i, r in self.records if r.compared_nothing]

    @property
    def first_divergence(self) -> tuple[int, AuditResult] | None:
        return next(iter(self.diverged), None)

    @property
    def recurred(self) -> list[Recurrence]:
        """Divergences that came back after a resync repaired them: an audit naming, beyond the tolerance, a
        rank or a tensor that an earlier resync of this report repaired, or carrying the engine's hint that a
        rank diverged again after its resync. A cause that comes back after its repair is not repaired."""
        ranks: dict[int, int | None] = {}
        names: dict[str, int | None] = {}
        out = []
        for line, r in self.diverged:
            beyond = r.beyond_tolerance
            again_ranks = sorted({x for m in beyond for x in m.ranks} & set(ranks))
            again_names = sorted({m.name for m in beyond} & set(names))
            said = any(RECURRED_HINT in h for h in r.hints)
            if again_ranks or again_names or said:
                first = [ranks[x] for x in again_ranks] + [names[n] for n in again_names]
                since = min((s for s in first if s is not None), default=None)
                out.append(Recurrence(line, r, again_ranks, again_names, since))
            if r.action == "resynced":
                ranks.update({x: r.step for m in beyond for x in m.ranks if x not in ranks})
                names.update({m.name: r.step for m in beyond if m.name not in names})
        return out

    @property
    def repaired(self) -> bool:
        """Every divergence was repaired by ``resync`` (confirmed by a full audit), none came back after its
        repair (:attr:`recurred`), and the run ended in sync."""
        rs = self.results
        if not self.diverged or not rs:
            return False
        last = rs[-1]
        ended_in_sync = last.in_sync or last.within_tolerance or last.action == "resynced"
        return ended_in_sync and all(r.action == "resynced" for _, r in self.diverged) and not self.recurred

    @property
    def checkpoint_failures(self) -> list[dict[str, Any]]:
        """``{"line", "step", "path", "event", "status", "why"}`` of every record whose checkpoint was loaded
        changed or unverified, or whose resume check found a difference (``checkpoint.resume.status``)."""
        out = []
        for i, r in self.records:
            c = r.checkpoint or {}
            resume = c.get("resume") if isinstance(c.get("resume"), dict) else {}
            why = []
            if c.get("event") == "loaded" and c.get("status") in ("changed", "unverified"):
                said = [n for n in r.notes if n.startswith(f"checkpoint {c.get('path')} is ")]
                why.append(said[0] if said else f"checkpoint {c.get('path')} is {c['status']}")
            if resume.get("status") == "differs":
                found = [f.get("detail") for f in resume.get("findings", []) if isinstance(f, dict)]
                why.append("resume differs: " + ("; ".join(str(d) for d in found if d) or "see the record"))
            if why:
                row = {"line": i, "step": r.step, "path": c.get("path"), "event": c.get("event")}
                out.append({**row, "status": c.get("status"), "resume": resume.get("status"), "why": why})
        return out

    @property
    def status(self) -> str:
        """``invalid``, ``empty``, ``diverged``, ``repaired`` (only with ``accept_repaired``), ``checkpoint`` (a
        checkpoint loaded changed or unverified, or a resume that differs), ``nothing_compared`` (no audit
        compared a tensor between ranks: no verdict either way) or ``in_sync``."""
        if self.blocking_errors:
            return "invalid"
        if not self.records:
            return "empty"
        if self.diverged and self.accept_repaired and self.repaired and not self.checkpoint_failures:
            return "repaired"
        if self.diverged:
            return "diverged"
        if self.checkpoint_failures:
            return "checkpoint"
        if len(self.compared_nothing) == len(self.records):
            return "nothing_compared"
        return "in_sync"

    @property
    def exit_code(self) -> int:
        """0 in sync (or repaired, accepted), 1 diverged or a checkpoint failed, 2 invalid, empty or nothing compared (no verdict)."""
        codes = {
            "invalid": EXIT_ERROR,
            "empty": EXIT_ERROR,
            "nothing_compared": EXIT_ERROR,
            "diverged": EXIT_DIFFERENT,
            "checkpoint": EXIT_DIFFERENT,
            "repaired": EXIT_OK,
        }
        return codes.get(self.status, EXIT_OK)

    def headline(self) -> str:
        rs = self.results
        if not rs:
            return f"{self.path}: no audit records"
        steps = [r.step for r in rs if r.step is not None]
        epochs = [r.epoch for r in rs if r.epoch is not None]
        worlds = sorted({r.world_size for r in rs})
        parts = [f"{len(rs)} audit(s)"]
        if steps:
            parts.append(f"steps {min(steps)}-{max(steps)}" if min(steps) != max(steps) else f"step {steps[0]}")
        if epochs:
            parts.append(f"epochs {min(epochs)}-{max(epochs)}" if min(epochs) != max(epochs) else f"epoch {epochs[0]}")
        parts.append(f"{'/'.join(map(str, worlds))} rank(s)")
        return f"{self.path}: " + ", ".join(parts)

    def segments(self) -> list[Segment]:
        out: list[Segment] = []
        for r in self.results:
            names = tuple(r.diverged_names)
            gaps = [m.max_abs_diff for m in r.mismatches if m.max_abs_diff is not None]
            gap = max(gaps) if gaps else None
            cur = out[-1] if out else None
            same = cur is not None and cur.last.within_tolerance == r.within_tolerance
            if cur is not None and same and cur.in_sync == r.in_sync and cur.names == names:
                cur.last = r
                cur.audits += 1
                if gap is not None and (cur.max_gap is None or gap > cur.max_gap):
                    cur.max_gap = gap
            else:
                out.append(Segment(r, r, 1, r.in_sync, names, gap))
        return out

    def layers(self) -> list[LayerRow]:
        rows: dict[str, LayerRow] = {}
        for r in self.results:
            seen: set[str] = set()
            for m in r.mismatches:
                layer = layer_of(m.name, m.kind)
                row = rows.setdefault(layer, LayerRow(layer))
                row.tensors.setdefault(m.name + (f"@{fmt_shard(m.shard)}" if m.shard else ""), None)
                row.kinds.setdefault(m.kind, None)
                row.ranks.update(m.ranks)
                row.reference_ranks.update(m.reference_ranks)
                if row.first is None:
                    row.first = r
                row.last = r
                if layer not in seen:
                    row.audits += 1
                    row.last_gap = None
                    seen.add(layer)
                if m.max_abs_diff is not None:
                    row.worst_gap = max(row.worst_gap or 0.0, m.max_abs_diff)
                    row.last_gap = max(row.last_gap or 0.0, m.max_abs_diff)
        return list(rows.values())

    def hints(self) -> list[str]:
        return list(dict.fromkeys(h for r in self.results for h in r.hints))

    # -- machine form --------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        rs = self.results
        first = self.first_divergence
        out: dict[str, Any] = {
            "report": self.path,
            "status": self.status,
            "exit_code": self.exit_code,
            "audits": len(rs),
            "diverged_audits": len(self.diverged),
            "world_size": rs[-1].world_size if rs else None,
            "first_step": rs[0].step if rs else None,
            "last_step": rs[-1].step if rs else None,
            "resynced_audits": sum(r.action == "resynced" for r in rs),
            "within_tolerance_audits": len(self.within_tolerance),
            "nothing_compared_audits": len(self.compared_nothing),
            "in_sync_at_end": rs[-1].in_sync if rs else None,
            "repaired": self.repaired,
            "recurred": [x.to_dict() for x in self.recurred],
            "sampled_audits": sum(r.sampled for r in rs),
            "last_full_sync_step": rs[-1].last_full_sync_step if rs else None,
            "first_divergence": None,
            "checkpoints": self.checkpoint_failures,
            "errors": [{"line": e.line, "torn": e.torn, "message": str(e)} for e in self.errors],
        }
        if first is not None:
            line, r = first
            out["first_divergence"] = {
                "line": line,
                "step": r.step,
                "epoch": r.epoch,
                "hook": r.hook,
                "time": r.time,
                "last_in_sync_step": r.last_in_sync_step,
                "first_diverged_step": r.first_diverged_step,
                "pinpoint": r.pinpoint,
                "tensors": r.diverged_names,
                "ranks": diverged_ranks(r.mismatches),
                "reference_ranks": sorted({x for m in r.mismatches for x in m.reference_ranks}),
                "hosts": dict(r.hosts or {}),
                "blame": r.blame,
                "tie": any(m.tie for m in r.mismatches),
                "hints": list(r.hints),
                "mismatches": [m.to_dict() for m in r.mismatches],
            }
        return out


def _not_a_report(path: str) -> str | None:
    """What ``path`` holds when it is plainly no text report (binary data, a checkpoint), else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if head.startswith(b"PK\x03\x04") or head.startswith(b"\x80"):
        return "a zip archive or pickle: a checkpoint? compare checkpoints with: weightsync-audit diff A B"
    if b"\0" in head:
        return "binary data"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not merely a character cut at the end of the chunk
            return "binary data, not UTF-8 text"
    return None


def fmt_step(step: int | None) -> str:
    """A step for a table or a sentence: ``-`` when the record has none (an audit outside training)."""
    return "-" if step is None else str(step)


def diverged_ranks(mismatches: list[Mismatch]) -> list[int]:
    return sorted({r for m in mismatches for r in m.ranks})


def pinpoint_line(r: AuditResult) -> str | None:
    """Where a divergent record says the divergence began, in words (None when it says nothing)."""
    if r.pinpoint == "exact" and r.first_diverged_step is not None:
        return f"began at step {r.first_diverged_step} (pinpointed from per-step digests; in sync at step {fmt_step(r.last_in_sync_step)})"
    if r.pinpoint == "sampled" and r.first_diverged_step is not None:
        return f"showed at step {r.first_diverged_step} (sampled per-step digests: it may have begun earlier)"
    if r.pinpoint in ("overflow", "earlier", "unseen", "unavailable"):
        return f"began: not pinpointed ({r.pinpoint}; see the record's notes)"
    return None


def _repeated(r: AuditResult, prev: AuditResult | None) -> bool:
    """``r``'s transient span lies wholly within the steps the audit before it (same run) already covered."""
    last = (r.transient or {}).get("last_diverged_step")
    if prev is None or last is None or prev.step is None or r.step is None or not prev.step < r.step:
        return False
    return last <= prev.step
