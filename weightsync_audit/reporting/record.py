"""What is reported: :class:`AuditResult` and :class:`Mismatch`, and the JSON record they make.

The record (``schema: "weightsync-audit/1"``) is the public contract: one JSON object per audit.
``from_dict`` validates a record and says which field is wrong, so a report reader can name the line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Literal, Mapping, get_args

from weightsync_audit.errors import ReportFormatError
from weightsync_audit.text import brief_names

__all__ = ["ACTIONS", "MISMATCH_KINDS", "SCHEMA", "Action", "AuditResult", "Kind", "Mismatch"]

SCHEMA = "weightsync-audit/1"
Action = Literal["none", "warned", "raised", "resynced"]
"""What was done about an audit's result: nothing (raw ``audit``), warned, raised, resynced."""
Kind = Literal["param", "buffer", "optimizer", "grad", "structure"]
"""What a mismatched tensor is; ``structure`` when it is missing or has another shape or dtype somewhere."""
ACTIONS: tuple[str, ...] = get_args(Action)
MISMATCH_KINDS: tuple[str, ...] = get_args(Kind)
_CHECKED_KINDS = ("param", "buffer", "optimizer", "grad")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


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

    def to_dict(self) -> dict[str, Any]:
        d = {
            "name": self.name,
            "kind": self.kind,
            "ranks": list(self.ranks),
            "reference_ranks": list(self.reference_ranks),
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype,
            "max_abs_diff": _finite_or_none(self.max_abs_diff),
            "detail": self.detail,
        }
        if self.shard is not None:
            d["shard"] = dict(self.shard)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Mismatch:
        _require(d, "mismatch", {"name": str, "kind": str, "ranks": list, "reference_ranks": list})
        if d["kind"] not in MISMATCH_KINDS:
            raise ReportFormatError(f"mismatch kind {d['kind']!r} is not one of {list(MISMATCH_KINDS)}")
        for key in ("ranks", "reference_ranks"):
            if not all(isinstance(r, int) and not isinstance(r, bool) for r in d[key]):
                raise ReportFormatError(f"mismatch {key} must be a list of integers, got {d[key]!r}")
        shape = d.get("shape")
        if shape is not None and not (isinstance(shape, list) and all(isinstance(s, int) for s in shape)):
            raise ReportFormatError(f"mismatch shape must be a list of integers or null, got {shape!r}")
        diff = d.get("max_abs_diff")
        if diff is not None and (isinstance(diff, bool) or not isinstance(diff, (int, float))):
            raise ReportFormatError(f"mismatch max_abs_diff must be a number or null, got {diff!r}")
        shard = d.get("shard")
        if shard is not None and not (
            isinstance(shard, dict)
            and all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in shard.items())
        ):
            raise ReportFormatError(f"mismatch shard must be an object of mesh dimension -> integer, got {shard!r}")
        return cls(
            name=d["name"],
            kind=d["kind"],
            ranks=list(d["ranks"]),
            reference_ranks=list(d["reference_ranks"]),
            shape=list(shape) if shape is not None else None,
            dtype=d.get("dtype"),
            max_abs_diff=float(diff) if diff is not None else None,
            detail=d.get("detail"),
            shard=dict(shard) if shard is not None else None,
        )


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
    checked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_CHECKED_KINDS, 0))
    hook: str | None = None
    action: Action = "none"
    last_in_sync_step: int | None = None
    duration_ms: float = 0.0
    time: str = field(default_factory=_now)
    notes: list[str] = field(default_factory=list)
    coverage: str | None = None
    """``"k/n"`` in sampled mode: this audit hashed slice k of n of every large tensor."""

    @property
    def diverged_names(self) -> list[str]:
        return [m.name for m in self.mismatches]

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
            "checked": {k: int(self.checked.get(k, 0)) for k in _CHECKED_KINDS},
            "mismatches": [m.to_dict() for m in self.mismatches],
            "hints": list(self.hints),
            "action": self.action,
            "duration_ms": round(float(self.duration_ms), 3),
        }
        if self.notes:
            d["notes"] = list(self.notes)
        if self.coverage:
            d["coverage"] = self.coverage
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AuditResult:
        """Rebuild a result from a record; :class:`ReportFormatError` names what is wrong."""
        if not isinstance(d, Mapping):
            raise ReportFormatError(f"a record must be a JSON object, got {type(d).__name__}")
        if d.get("schema") != SCHEMA:
            raise ReportFormatError(f"schema is {d.get('schema')!r}, expected {SCHEMA!r}")
        _require(
            d,
            "record",
            {"in_sync": bool, "world_size": int, "mismatches": list, "hints": list, "checked": dict, "action": str},
        )
        for key in ("step", "epoch", "last_in_sync_step"):
            v = d.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ReportFormatError(f"{key} must be an integer or null, got {v!r}")
        if d["action"] not in ACTIONS:
            raise ReportFormatError(f"action {d['action']!r} is not one of {list(ACTIONS)}")
        mismatches = [Mismatch.from_dict(m) if isinstance(m, Mapping) else _bad_mismatch(m) for m in d["mismatches"]]
        if d["in_sync"] and mismatches:
            raise ReportFormatError("in_sync is true but mismatches are listed")
        return cls(
            in_sync=d["in_sync"],
            step=d.get("step"),
            epoch=d.get("epoch"),
            world_size=d["world_size"],
            mismatches=mismatches,
            hints=[str(h) for h in d["hints"]],
            checked={k: int(d["checked"].get(k, 0)) for k in _CHECKED_KINDS},
            hook=d.get("hook"),
            action=d["action"],
            last_in_sync_step=d.get("last_in_sync_step"),
            duration_ms=float(d.get("duration_ms") or 0.0),
            time=str(d.get("time") or ""),
            notes=[str(n) for n in d.get("notes", [])],
            coverage=d.get("coverage"),
        )

    def summary(self) -> str:
        """One line: what was checked and what differs."""
        where = f"step {self.step}" if self.step is not None else "audit"
        if self.epoch is not None:
            where += f" (epoch {self.epoch})"
        n = sum(self.checked.values())
        if self.in_sync:
            return f"{where}: in sync across {self.world_size} rank(s), {n} tensors checked"
        ranks = sorted({r for m in self.mismatches for r in m.ranks})
        return (
            f"{where}: DIVERGED, {len(self.mismatches)} of {n} tensors differ on rank(s) {ranks}"
            f" (first: {self.mismatches[0].name})"
        )

    def divergence_message(self) -> str:
        """The message of the :class:`~weightsync_audit.WeightDivergenceError` this result raises."""
        names = brief_names((m.name for m in self.mismatches), 5)
        message = (
            f"weights diverged across ranks at step {self.step}: {len(self.mismatches)} tensor(s) differ ({names})"
        )
        if self.hints:
            message += "\nhint: " + "\nhint: ".join(self.hints)
        return message

    def __rich_console__(self, console: Any, options: Any) -> Iterable[Any]:
        from weightsync_audit.reporting.render import render_result

        yield from render_result(self)


def _bad_mismatch(m: Any) -> Mismatch:
    raise ReportFormatError(f"each mismatch must be a JSON object, got {m!r}")


def _require(d: Mapping[str, Any], what: str, fields: Mapping[str, type]) -> None:
    for key, typ in fields.items():
        if key not in d:
            raise ReportFormatError(f"{what} lacks the field {key!r}")
        v = d[key]
        ok = isinstance(v, typ) and not (typ is int and isinstance(v, bool))
        if not ok:
            raise ReportFormatError(f"{what} field {key!r} must be {typ.__name__}, got {v!r}")
