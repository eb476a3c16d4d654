"""What is reported: :class:`AuditResult` and :class:`Mismatch`, and the JSON record they make.

The record (``schema: "weightsync-audit/1"``) is the public contract: one JSON object per audit.
``from_dict`` validates a record (:mod:`weightsync_audit.reporting.validate`) and says which field is
wrong, so a report reader can name the line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from time import gmtime, strftime, time_ns
from typing import Any, Callable, Iterable, Mapping

from weightsync_audit.reporting.validate import (
    ACTIONS,
    CHECKED_KINDS,
    MISMATCH_KINDS,
    PINPOINT_STATES,
    SCHEMA,
    Action,
    Kind,
    PinpointState,
    validate_mismatch,
    validate_record,
)
from weightsync_audit.text import NOTHING_COMPARED, NOTHING_TO_AUDIT, brief_names, fmt_ranks, is_tie

__all__ = [
    "ACTIONS",
    "MISMATCH_KINDS",
    "PINPOINT_STATES",
    "SCHEMA",
    "Action",
    "AuditResult",
    "Kind",
    "Mismatch",
    "PinpointState",
]

_stamp: tuple[int, str] = (-1, "")
"""The last second a record was stamped in, and its text: the date and time are formatted once a second."""


def _now() -> str:
    """Now, in UTC, to the microsecond (``2026-01-02T03:04:05.678901Z``)."""
    global _stamp
    sec, us = divmod(time_ns() // 1000, 1_000_000)
    if _stamp[0] != sec:
        _stamp = (sec, strftime("%Y-%m-%dT%H:%M:%S", gmtime(sec)))
    return f"{_stamp[1]}.{us:06d}Z"


def _put_present(d: dict[str, Any], obj: Any, fields: Mapping[str, Callable[[Any], Any]]) -> None:
    """Set ``d[name] = convert(obj.name)`` for each of ``fields`` in order, leaving out a value that is
    ``None``: a record's optional fields, absent when unset."""
    for name, convert in fields.items():
        value = getattr(obj, name)
        if value is not None:
            d[name] = convert(value)


def _finite_or_none(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass(slots=True)
class Mismatch:
    """One tensor on which ranks disagree.

    ``ranks`` disagree with the reference value, held by ``reference_ranks`` (the majority; a tie goes
    to the group holding the lowest rank).
    """

    name: str
    kind: Kind
    ranks: list[int]
    reference_ranks: list[int]
    shape: list[int] | None = None
    dtype: str | None = None
    max_abs_diff: float | None = None
    detail: str | None = None
    shard: dict[str, int] | None = None
    """For a sharded tensor (DTensor): the mesh coordinates of the shard that differs, e.g. ``{"dp": 0}``."""

    rel_diff: float | None = None
    """``max_abs_diff`` over the largest magnitude in the reference copy (None: not measured)."""
    within_tolerance: bool | None = None
    """With a ``tolerance`` in force: a float whose ``rel_diff`` is at most the tolerance, spread like drift
    (see ``docs/report-schema.md``). Never for an integer or bool. None: no tolerance."""
    nonfinite: dict[int, int] | None = None
    """The ranks whose copy holds NaN or inf, with how many such elements (None: no copy does, or not a
    value mismatch). Counted on every diverged tensor."""
    diff_count: int | None = None
    """How many elements differ from the reference copy (the odd rank furthest off); None: not measured."""
    stability: str | None = None
    """``stable`` / ``unstable``: whether a second read of the odd ranks' copy gave the same digest (None: not read)."""
    first_diverged_step: int | None = None
    """With pinpoint: the first recorded step at which this tensor's own bytes differed between the ranks,
    when the per-step digests date it exactly (None: not dated; the record's ``first_diverged_step`` is the
    earliest of all, and its ``pinpoint`` says how sure)."""

    @property
    def diff_share(self) -> float | None:
        """``diff_count`` over the tensor's element count (None: not measured or no shape)."""
        if self.diff_count is None or self.shape is None:
            return None
        return self.diff_count / max(1, math.prod(self.shape))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "ranks": list(self.ranks),
            "reference_ranks": list(self.reference_ranks),
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype,
            "max_abs_diff": _finite_or_none(self.max_abs_diff),
            "detail": self.detail,
        }
        _put_present(d, self, {"shard": dict, "rel_diff": _finite_or_none, "within_tolerance": bool})
        if self.nonfinite:
            d["nonfinite"] = {str(r): int(n) for r, n in sorted(self.nonfinite.items())}
        if self.diff_count is not None:
            d["diff_count"] = int(self.diff_count)
            d["diff_share"] = self.diff_share
        _put_present(d, self, {"stability": str, "first_diverged_step": int})
        return d

    @property
    def tie(self) -> bool:
        """The reference was decided by a tie vote, not a majority (``detail`` names the sides)."""
        return is_tie(self.detail)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Mismatch:
        """Rebuild a mismatch; :class:`ReportFormatError` names the field that is wrong."""
        return cls._from_valid(validate_mismatch(dict(d) if isinstance(d, Mapping) else d))

    @classmethod
    def _from_valid(cls, v: dict[str, Any]) -> Mismatch:
        return cls(**{f.name: v[f.name] for f in dataclass_fields(cls)})


@dataclass(slots=True)
class AuditResult:
    """The outcome of one audit, identical on every rank.

    >>> r = AuditResult(in_sync=True, step=3, world_size=2)
    >>> AuditResult.from_dict(r.to_dict()).step
    3
    """

    in_sync: bool
    step: int | None = None
    epoch: int | None = None
    world_size: int = 1
    mismatches: list[Mismatch] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHECKED_KINDS, 0))
    hook: str | None = None
    action: Action = "none"
    last_in_sync_step: int | None = None
    duration_ms: float = 0.0
    time: str = field(default_factory=_now)
    notes: list[str] = field(default_factory=list)
    coverage: str | None = None
    """``"k/n"`` in sampled mode: this audit hashed slice k of n of every large tensor."""
    last_full_sync_step: int | None = None
    """The last step at which an audit read every byte (no sampling) and found the ranks in sync."""

    @property
    def sampled(self) -> bool:
        """This audit read a share of each large tensor only (``coverage`` says which)."""
        return bool(self.coverage)

    @property
    def lead_mismatch(self) -> Mismatch | None:
        """The mismatch to name first: a parameter where one differs, else the first listed."""
        return next((m for m in self.mismatches if m.kind == "param"), self.mismatches[0] if self.mismatches else None)

    first_diverged_step: int | None = None
    """With pinpoint: the first step whose per-step digests disagreed (see ``pinpoint`` for how sure)."""
    pinpoint: PinpointState | None = None
    """On a divergent record: ``exact``, ``sampled``, ``overflow``, ``earlier``, ``unseen``, ``unavailable``, ``off``
    (see PINPOINT_STATES)."""
    tolerance: float | None = None
    """The relative tolerance in force, or None (exact)."""
    nonfinite_count: int | None = None
    """With ``check_finite``: how many audited tensors hold NaN or inf (the most on any rank); None: not
    counted. An in-sync record with a count above 0 says so in ``notes``."""
    transient: dict[str, Any] | None = None
    """Replicas that differed at some step since the last audit and agree again now (seen through the
    pinpoint rings): ``{"first_diverged_step", "last_diverged_step", "names"}``; None: nothing seen."""
    hosts: dict[str, str] | None = None
    """On a divergent record: global rank -> ``"host local_rank device"`` of each rank it names."""
    checkpoint: dict[str, Any] | None = None
    """At a checkpoint save or load: ``{"path", "event", "status", "saved_step"}`` (docs/restarts.md)."""
    blame: dict[str, Any] | None = None
    """On a divergent record: ``{"ranks", "evidence", "cause", "hardware_suspect", "step", "detail"}``, the
    rank(s) held responsible and why (docs/report-schema.md); ``ranks: []`` is undecided (a tie, say)."""
    overlap: dict[str, Any] | None = None
    """An overlapped audit's (``overlap=True``): ``{"covers_step", "settled_at", "waited_ms", "audit_ms"}``
    and ``"raced": true`` when it was audited again at rest (docs/report-schema.md)."""
    nothing_compared: bool | None = None
    """``True`` on a record whose audit compared no tensor between ranks (none to audit, or none with a
    replica; ``notes`` says which): it found no difference, and proves no agreement either."""
    torchft: dict[str, Any] | None = None
    """An audit across torchft replica groups: ``{"quorum_id", "group_rank", "point", "replicas", "absent",
    "healed"}`` and at a LocalSGD/DiLoCo sync point ``"sync"`` (docs/torchft.md)."""

    @property
    def compared_nothing(self) -> bool:
        """The audit compared no tensor (``nothing_compared``, or an older record's note saying so)."""
        if self.nothing_compared:
            return True
        return self.in_sync and not any(self.checked.values()) and any(_says_nothing(n) for n in self.notes)

    @property
    def diverged_names(self) -> list[str]:
        return [m.name for m in self.mismatches]

    @property
    def beyond_tolerance(self) -> list[Mismatch]:
        """The mismatches that count: all of them, unless a tolerance holds some within it."""
        return [m for m in self.mismatches if not m.within_tolerance]

    @property
    def within_tolerance(self) -> bool:
        """Replicas differ, but every difference is within the tolerance (never true without one)."""
        return bool(self.mismatches) and not self.beyond_tolerance

    def to_dict(self) -> dict[str, Any]:
        """The report record, exactly as the contract gives it (plus ``notes`` / ``coverage`` when set)."""
        d: dict[str, Any] = {
            "schema": SCHEMA,
            "time": self.time,
            "step": self.step,
            "epoch": self.epoch,
            "hook": self.hook,
            "world_size": self.world_size,
            "in_sync": self.in_sync,
            "last_in_sync_step": self.last_in_sync_step,
            "checked": {k: int(self.checked.get(k, 0)) for k in CHECKED_KINDS},
            "mismatches": [m.to_dict() for m in self.mismatches],
            "hints": list(self.hints),
            "action": self.action,
            "duration_ms": round(float(self.duration_ms), 3),
        }
        if self.notes:
            d["notes"] = list(self.notes)
        if self.coverage:
            d["coverage"] = self.coverage
        if self.coverage or self.last_full_sync_step is not None:
            d["last_full_sync_step"] = self.last_full_sync_step
        if self.pinpoint is not None:
            d["pinpoint"] = self.pinpoint
            d["first_diverged_step"] = self.first_diverged_step
        _put_present(d, self, {"transient": dict, "tolerance": float})
        if self.tolerance is not None and not self.in_sync:
            d["within_tolerance"] = self.within_tolerance
        _put_present(d, self, {"nonfinite_count": int})
        if self.hosts:
            d["hosts"] = dict(self.hosts)
        _put_present(
            d, self, {"checkpoint": dict, "blame": dict, "overlap": dict, "nothing_compared": bool, "torchft": dict}
        )
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AuditResult:
        """Rebuild a result from a record; :class:`ReportFormatError` names the field that is wrong."""
        v = validate_record(dict(d) if isinstance(d, Mapping) else d)
        v["mismatches"] = [Mismatch._from_valid(m) for m in v["mismatches"]]
        v["checked"] = {k: v["checked"][k] for k in CHECKED_KINDS}
        return cls(**{f.name: v[f.name] for f in dataclass_fields(cls)})

    def summary(self, *, tie: bool = True) -> str:
        """One line: what was checked, what differs, from which step when pinpointed (and, when sampled,
        what share was read). ``tie=False`` leaves out the tie clause (a report that says it on its own line)."""
        where = f"step {self.step}" if self.step is not None else "audit"
        if self.epoch is not None:
            where += f" (epoch {self.epoch})"
        n = sum(self.checked.values())
        share = f", sampled: read {self.coverage} of each large tensor" if self.coverage else ""
        if self.in_sync and self.compared_nothing:  # no difference found, and no agreement proven either
            why = next((x for x in self.notes if _says_nothing(x)), "nothing was compared")
            return f"{where}: {self.world_size} rank(s), {why}{share}"
        if self.in_sync:
            return f"{where}: in sync across {self.world_size} rank(s), {n} tensors checked{share}"
        ranks = sorted({r for m in self.mismatches for r in m.ranks})
        lead = self.lead_mismatch
        assert lead is not None
        ties = [m for m in self.mismatches if m.tie]
        sides = sorted({r for m in ties for r in m.reference_ranks}), sorted({r for m in ties for r in m.ranks})
        tie_clause = f"; TIE vote on {len(ties)}: {fmt_ranks(sides[0])} vs {fmt_ranks(sides[1])}, no majority"
        began = ""
        if self.first_diverged_step is not None:
            began = f"; diverged from step {self.first_diverged_step} (pinpointed, {self.pinpoint})"
        on = f"on rank(s) {ranks}"
        if ties and len(ties) == len(self.mismatches):  # no side is the odd one: both are said
            on = f"between {fmt_ranks(sides[0])} and {fmt_ranks(sides[1])}"
        return (
            f"{where}: DIVERGED, {self.differing} of {n} tensors differ {on}"
            f" (first: {lead.name}){began}{tie_clause if ties and tie else ''}{share}"
        )

    @property
    def differing(self) -> int:
        """How many distinct tensors differ (a tensor with several mismatches, across ranks and against a
        checkpoint, counts once)."""
        return len({(m.kind, m.name) for m in self.mismatches})

    def divergence_message(self) -> str:
        """The message of the :class:`~weightsync_audit.WeightDivergenceError` this result raises: its first line
        names the step, the tensors, the ranks that differ and the blamed ones (enough for a CI log)."""
        ordered = sorted(self.mismatches, key=lambda m: m.kind != "param")
        names = brief_names((m.name for m in ordered), 5)
        odd = sorted({r for m in self.mismatches for r in m.ranks})
        held = sorted({r for m in self.mismatches for r in m.reference_ranks} - set(odd))
        against = f" against {fmt_ranks(held)}" if held else ""
        tie = " (a tie: no majority)" if any(m.tie for m in self.mismatches) else ""
        blamed = (self.blame or {}).get("ranks") or []
        who = f"; blamed: {fmt_ranks(blamed)} ({self.blame['evidence']})" if blamed and self.blame else ""
        message = (
            f"weights diverged across ranks {'at an audit' if self.step is None else f'at step {self.step}'}: "
            f"{self.differing} tensor(s) differ ({names}) on {fmt_ranks(odd) if odd else 'no rank named'}"
            f"{against}{tie}{who}"
        )
        if self.hints:
            message += "\nhint: " + "\nhint: ".join(self.hints)
        return message

    def __rich_console__(self, console: Any, options: Any) -> Iterable[Any]:
        from weightsync_audit.reporting.render import render_result

        yield from render_result(self)


def _says_nothing(note: str) -> bool:
    return note.startswith((NOTHING_COMPARED, NOTHING_TO_AUDIT))
