"""The one validation kit of what the library reads back: a report record (shared by
``AuditResult.from_dict``, ``check``, ``show`` and ``--plot``) and its ``blame`` field here; one report line
read as JSON and a checkpoint sidecar (``weightsync-checkpoint/1``) in :mod:`.json_line`.

The checks are a table: one line per field (:data:`RECORD_FIELDS`, :data:`MISMATCH_FIELDS`), so a new
field is one new line. Every malformed field raises :class:`~weightsync_audit.errors.ReportFormatError`
naming the field (``mismatches[0].detail``) and the value; nothing else ever escapes (no ``TypeError``,
``OverflowError`` or ``RecursionError`` from odd values). Fields the table does not know are accepted and
ignored, so a reader keeps working on records written by a newer writer.

>>> validate_record({"schema": "weightsync-audit/1", "in_sync": True, "world_size": 2, "mismatches": [],
...                  "hints": [], "checked": {"param": 2}, "action": "none"})["checked"]["param"]
2
>>> validate_record({"schema": "weightsync-audit/1", "in_sync": True, "world_size": 2, "mismatches": [],
...                  "hints": [], "checked": {"param": 2}, "action": "none", "notes": "abc"})
Traceback (most recent call last):
...
weightsync_audit.errors.ReportFormatError: field 'notes' must be a list of strings, got 'abc'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping, get_args

from weightsync_audit.errors import ReportFormatError
from weightsync_audit.reporting.json_line import (
    DIGITS,
    Check,
    boolean,
    entries,
    fail,
    integer,
    is_int,
    list_of,
    number,
    one_of,
    optional,
    record_of,
    shown,
    string,
)

__all__ = [
    "SCHEMA",
    "Action",
    "Kind",
    "PinpointState",
    "ACTIONS",
    "MISMATCH_KINDS",
    "CHECKED_KINDS",
    "PINPOINT_STATES",
    "FieldSpec",
    "RECORD_FIELDS",
    "MISMATCH_FIELDS",
    "validate_record",
    "validate_mismatch",
    "BLAME_EVIDENCE",
    "blame_entry",
]

SCHEMA = "weightsync-audit/1"
Action = Literal["none", "warned", "raised", "resynced"]
"""What was done about an audit's result: nothing (raw ``audit``), warned, raised, resynced."""
Kind = Literal["param", "buffer", "optimizer", "grad", "structure"]
"""What a mismatched tensor is; ``structure`` when it is missing or has another shape or dtype somewhere."""
PinpointState = Literal["exact", "sampled", "overflow", "earlier", "unseen", "unavailable", "off"]
"""How a divergent record's ``first_diverged_step`` was found: ``exact`` (per-step digests of everything
audited), ``sampled`` (of a slice per step: the divergence showed at that step, it may have begun
earlier, after ``last_in_sync_step``), ``overflow`` (the ring lost the steps that would tell; null),
``earlier`` (the first recorded step already differed and nothing before it is known good; null), ``unseen`` (every recorded step agreed: the change came after the last one; null), ``off`` (no pinpoint)."""
ACTIONS: tuple[str, ...] = get_args(Action)
MISMATCH_KINDS: tuple[str, ...] = get_args(Kind)
CHECKED_KINDS = MISMATCH_KINDS[:-1]
"""The kinds a record counts in ``checked`` (every kind but ``structure``)."""
PINPOINT_STATES: tuple[str, ...] = get_args(PinpointState)
STABILITIES = ("stable", "unstable")
CHECKPOINT_STATES = ("verified", "diverged", "unverified", "matching", "changed", "sampled")

_COVERAGE = re.compile(r"[1-9][0-9]{0,8}/[1-9][0-9]{0,8}")


def coverage(v: Any, path: str) -> str:
    if not isinstance(v, str) or not _COVERAGE.fullmatch(v):
        raise fail(path, 'a share such as "1/8"', v)
    k, n = (int(x) for x in v.split("/"))
    if k > n:
        raise fail(path, 'a share such as "1/8" (k/n with k <= n)', v)
    return v


def checked_counts(v: Any, path: str) -> dict[str, int]:
    """Tensors checked per kind; the known kinds default to 0, other kinds must be counts too."""
    if not isinstance(v, dict):
        raise fail(path, "an object of counts per kind", v)
    count = integer(0)
    out = dict.fromkeys(CHECKED_KINDS, 0)
    for k, n in v.items():
        out[str(k)] = count(n, f"{path}.{k}")
    return out


shard_coords = entries(integer(0), "an object of mesh dimension -> integer >= 0")
"""Mesh coordinates of a shard: ``{"dp": 0}``."""


def rank_counts(v: Any, path: str) -> dict[int, int]:
    """Counts per rank: ``{"1": 3}`` (a JSON object's keys are strings) read as ``{1: 3}``."""
    if not isinstance(v, dict):
        raise fail(path, "an object of rank -> count", v)
    out = {}
    for k, n in v.items():
        if not (isinstance(k, str) and k.isdigit()) or not is_int(n) or n < 0:
            raise fail(path, "an object of rank -> count (integers >= 0)", v)
        out[int(k)] = int(n)
    return out


def transient_span(v: Any, path: str) -> dict[str, Any]:
    """``{"first_diverged_step", "last_diverged_step", "names"}``: steps (or null) and tensor names."""
    if not isinstance(v, dict):
        raise fail(path, 'an object {"first_diverged_step", "last_diverged_step", "names"}', v)
    step = optional(integer())
    first = step(v.get("first_diverged_step"), f"{path}.first_diverged_step")
    last = step(v.get("last_diverged_step"), f"{path}.last_diverged_step")
    names = list_of(string, "strings")(v.get("names", []), f"{path}.names")
    if (first is None) != (last is None) or (first is not None and last is not None and last < first):
        raise fail(f"{path}.last_diverged_step", "a step >= first_diverged_step (both or neither null)", last)
    return {"first_diverged_step": first, "last_diverged_step": last, "names": names}


def mismatch_list(v: Any, path: str) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise fail(path, "a list of mismatch objects", v)
    return [validate_mismatch(m, f"{path}[{i}]") for i, m in enumerate(v)]


rank_hosts = entries(string, "an object of rank -> host and device text", DIGITS)
"""Global rank (as a string) -> where it runs: ``{"1": "node-7 local_rank=1 cuda:1 GPU-..."}``."""

checkpoint_entry = record_of(
    "an object with path, event and status",
    {"path": string, "event": one_of(("saved", "loaded")), "status": one_of(CHECKPOINT_STATES),
     "saved_step": optional(integer()), "not_compared": optional(integer(0))},
)  # fmt: skip
"""``{"path", "event": saved|loaded, "status", "saved_step"}`` of an audit at a checkpoint, and at a load
``not_compared``: the tensors saved as partitions only (ZeRO-3), which no rank can compare whole."""


BLAME_EVIDENCE = (
    "vote",
    "at_rest_change",
    "at_rest_write",
    "update_not_reproducible",
    "collective_mismatch",
    "deterministic_difference",
    "undecided",
    "checkpoint",
)
"""What a record's ``blame`` rests on (docs/report-schema.md)."""


blame_entry = record_of(
    'an object {"ranks", "evidence", "hardware_suspect", ...}',
    {"ranks": list_of(integer(0), "ranks (integers >= 0)"), "evidence": one_of(BLAME_EVIDENCE),
     "hardware_suspect": boolean, "step": optional(integer()), "detail": optional(string), "cause": optional(string)},
)  # fmt: skip
"""``{"ranks", "evidence", "cause", "hardware_suspect", "step", "detail"}``; ``ranks: []`` is undecided."""

overlap_entry = record_of(
    "an object with covers_step, settled_at, waited_ms and audit_ms",
    {"covers_step": optional(integer()), "settled_at": string, "waited_ms": optional(number),
     "audit_ms": optional(number), "raced": optional(boolean)},
)  # fmt: skip
"""``{"covers_step", "settled_at", "waited_ms", "audit_ms"}`` (and ``"raced"``) of an overlapped audit."""


torchft_entry = record_of(
    "an object with quorum_id, group_rank, point, replicas, absent and healed",
    {"quorum_id": integer(), "group_rank": integer(0), "point": one_of(("step", "sync")),
     "replicas": entries(string, "an object of replica rank -> replica id", DIGITS),
     "absent": list_of(integer(0), "ranks (integers >= 0)"),
     "healed": entries(record_of("an object {source, verified, differs}", {"source": optional(integer(0)), "verified": boolean}),
                       "an object of replica rank -> {source, verified, differs}", DIGITS)},
    {"sync": record_of("an object", {})},
)  # fmt: skip
"""``{"quorum_id", "group_rank", "point", "replicas", "absent", "healed"}`` (and ``"sync"``) of an audit
across torchft replica groups (docs/torchft.md)."""


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """How one field is checked: ``check`` its value; ``required`` or else ``default``."""

    check: Check
    required: bool = False
    default: Any = None


_RANKS = list_of(integer(0), "ranks (integers >= 0)")

MISMATCH_FIELDS: dict[str, FieldSpec] = {
    "name": FieldSpec(string, required=True),
    "kind": FieldSpec(one_of(MISMATCH_KINDS), required=True),
    "ranks": FieldSpec(_RANKS, required=True),
    "reference_ranks": FieldSpec(_RANKS, required=True),
    "shape": FieldSpec(optional(list_of(integer(0), "sizes (integers >= 0)"))),
    "dtype": FieldSpec(optional(string)),
    "max_abs_diff": FieldSpec(optional(number)),
    "detail": FieldSpec(optional(string)),
    "shard": FieldSpec(optional(shard_coords)),
    "rel_diff": FieldSpec(optional(number)),
    "within_tolerance": FieldSpec(optional(boolean)),
    "nonfinite": FieldSpec(optional(rank_counts)),
    "diff_count": FieldSpec(optional(integer(0))),
    "diff_share": FieldSpec(optional(number)),
    "stability": FieldSpec(optional(one_of(STABILITIES))),
    "first_diverged_step": FieldSpec(optional(integer())),
}
"""One line per field of a mismatch; fields not listed are accepted and ignored."""

RECORD_FIELDS: dict[str, FieldSpec] = {
    "schema": FieldSpec(one_of((SCHEMA,)), required=True),
    "in_sync": FieldSpec(boolean, required=True),
    "time": FieldSpec(optional(string), default=""),
    "step": FieldSpec(optional(integer())),
    "epoch": FieldSpec(optional(integer())),
    "hook": FieldSpec(optional(string)),
    "world_size": FieldSpec(integer(1), required=True),
    "last_in_sync_step": FieldSpec(optional(integer())),
    "last_full_sync_step": FieldSpec(optional(integer())),
    "checked": FieldSpec(checked_counts, required=True),
    "mismatches": FieldSpec(mismatch_list, required=True),
    "hints": FieldSpec(list_of(string, "strings"), required=True),
    "action": FieldSpec(one_of(ACTIONS), required=True),
    "duration_ms": FieldSpec(optional(number), default=0.0),
    "notes": FieldSpec(list_of(string, "strings"), default=[]),
    "coverage": FieldSpec(optional(coverage)),
    "pinpoint": FieldSpec(optional(one_of(PINPOINT_STATES))),
    "first_diverged_step": FieldSpec(optional(integer())),
    "tolerance": FieldSpec(optional(number)),
    "within_tolerance": FieldSpec(optional(boolean)),
    "nonfinite_count": FieldSpec(optional(integer(0))),
    "transient": FieldSpec(optional(transient_span)),
    "hosts": FieldSpec(optional(rank_hosts)),
    "checkpoint": FieldSpec(optional(checkpoint_entry)),
    "blame": FieldSpec(optional(blame_entry)),
    "overlap": FieldSpec(optional(overlap_entry)),
    "nothing_compared": FieldSpec(optional(boolean)),
    "torchft": FieldSpec(optional(torchft_entry)),
}
"""One line per field of a record; fields not listed are accepted and ignored (forward compatible)."""


def _validate(d: Any, table: Mapping[str, FieldSpec], what: str, prefix: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ReportFormatError(f"{what} must be a JSON object, got {shown(d)}")
    out: dict[str, Any] = {}
    for key, spec in table.items():
        path = f"{prefix}{key}"
        if key not in d:
            if spec.required:
                raise ReportFormatError(f"{what} lacks the field {path!r}")
            out[key] = list(spec.default) if isinstance(spec.default, list) else spec.default
            continue
        value = spec.check(d[key], path)
        out[key] = spec.default if value is None and spec.default is not None else value
    return out


def validate_mismatch(d: Any, path: str = "mismatch") -> dict[str, Any]:
    """A mismatch object checked field by field; returns its known fields, normalised."""
    return _validate(d, MISMATCH_FIELDS, f"field {path!r}" if path != "mismatch" else "a mismatch", f"{path}.")


def validate_record(d: Any) -> dict[str, Any]:
    """A record checked field by field and as a whole; returns its known fields, normalised.

    Raises :class:`~weightsync_audit.errors.ReportFormatError` naming the first bad field.
    """
    out = _validate(d, RECORD_FIELDS, "a record", "")
    if out["transient"] is not None and not out["in_sync"]:
        raise ReportFormatError("field 'transient' is set on a divergent record (it describes a divergence healed)")
    if out["in_sync"] and out["mismatches"]:
        raise ReportFormatError("in_sync is true but mismatches are listed (field 'in_sync')")
    if out["nothing_compared"] and not out["in_sync"]:
        raise ReportFormatError("field 'nothing_compared' is true on a divergent record (something was compared)")
    if not out["in_sync"] and not out["mismatches"]:
        raise ReportFormatError("in_sync is false but no mismatch is listed (field 'in_sync')")
    _check_within_tolerance(out)
    return out


def _check_within_tolerance(out: dict[str, Any]) -> None:
    """``within_tolerance: true`` only where it can hold: a value mismatch, a tolerance, ``rel_diff`` within it."""
    tolerance = out["tolerance"]
    for i, m in enumerate(out["mismatches"]):
        if m["within_tolerance"] is not True:
            continue
        path = f"mismatches[{i}].within_tolerance"
        if m["kind"] == "structure":
            why = "a structure mismatch has no gap to tolerate"
        elif tolerance is None:
            why = "the record sets no 'tolerance'"
        elif m["rel_diff"] is None:
            why = "its 'rel_diff' was not measured"
        elif m["rel_diff"] > tolerance:
            why = f"its rel_diff {m['rel_diff']:g} exceeds the tolerance {tolerance:g}"
        else:
            continue
        raise ReportFormatError(f"field {path!r} is true but {why}")
    if out["within_tolerance"] is True and (
        tolerance is None or any(not m["within_tolerance"] for m in out["mismatches"])
    ):
        raise ReportFormatError("field 'within_tolerance' is true but some mismatch is not within a tolerance")
