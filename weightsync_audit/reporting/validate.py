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

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from weightsync_audit.errors import ReportFormatError
from weightsync_audit.reporting.json_line import OversizedNumber, json_skeleton, loads_record

__all__ = [
    "json_skeleton",
    "SCHEMA",
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
    "loads_record",
    "OversizedNumber",
]

SCHEMA = "weightsync-audit/1"
ACTIONS = ("none", "warned", "raised", "resynced")
MISMATCH_KINDS = ("param", "buffer", "optimizer", "grad", "structure")
CHECKED_KINDS = ("param", "buffer", "optimizer", "grad")
PINPOINT_STATES = ("exact", "sampled", "overflow", "earlier", "unseen", "unavailable", "off")
STABILITIES = ("stable", "unstable")
CHECKPOINT_STATES = ("verified", "diverged", "unverified", "matching", "changed", "sampled")

_INT_LIMIT = 2**63  # steps, counts and ranks are int64 everywhere else
_COVERAGE = re.compile(r"[1-9][0-9]{0,8}/[1-9][0-9]{0,8}")
Check = Callable[[Any, str], Any]
"""``check(value, field_path)`` returns the value to keep, or raises ReportFormatError."""


def _show(v: Any) -> str:
    """A short, safe rendering of any value for a message (huge, deep or odd values included)."""
    try:
        if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
            return f"an integer of {v.bit_length()} bits"
        text = repr(v)
    except Exception:  # noqa: BLE001 - RecursionError, ValueError on giant ints: describe it instead
        return f"a {type(v).__name__} too deep or too large to show"
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(path: str, must: str, v: Any) -> ReportFormatError:
    return ReportFormatError(f"field {path!r} must be {must}, got {_show(v)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -_INT_LIMIT < v < _INT_LIMIT


def integer(minimum: int | None = None) -> Check:
    must = "an integer" + ("" if minimum is None else f" >= {minimum}")

    def check(v: Any, path: str) -> int:
        if not _is_int(v) or (minimum is not None and v < minimum):
            raise _fail(path, must, v)
        return int(v)

    return check


def number(v: Any, path: str) -> float:
    """A finite number >= 0 (a gap, a duration)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(path, "a finite number >= 0", v)
    try:
        x = float(v)
    except OverflowError:
        raise _fail(path, "a finite number >= 0", v) from None
    if not math.isfinite(x) or x < 0:
        raise _fail(path, "a finite number >= 0", v)
    return x


def string(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise _fail(path, "a string", v)
    return v


def boolean(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise _fail(path, "true or false", v)
    return v


def one_of(choices: tuple[str, ...]) -> Check:
    def check(v: Any, path: str) -> str:
        if not isinstance(v, str) or v not in choices:
            raise _fail(path, f"one of {list(choices)}", v)
        return v

    return check


def optional(inner: Check) -> Check:
    """``inner``, or null."""

    def check(v: Any, path: str) -> Any:
        if v is None:
            return None
        try:
            return inner(v, path)
        except ReportFormatError as exc:
            raise ReportFormatError(f"{exc} (or null)") from None

    return check


def list_of(inner: Check, what: str) -> Check:
    def check(v: Any, path: str) -> list[Any]:
        if not isinstance(v, list):
            raise _fail(path, f"a list of {what}", v)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(inner(x, f"{path}[{i}]"))
            except ReportFormatError:
                raise _fail(path, f"a list of {what}", v) from None
        return out

    return check


def coverage(v: Any, path: str) -> str:
    if not isinstance(v, str) or not _COVERAGE.fullmatch(v):
        raise _fail(path, 'a share such as "1/8"', v)
    k, n = (int(x) for x in v.split("/"))
    if k > n:
        raise _fail(path, 'a share such as "1/8" (k/n with k <= n)', v)
    return v


def checked_counts(v: Any, path: str) -> dict[str, int]:
    """Tensors checked per kind; the known kinds default to 0, other kinds must be counts too."""
    if not isinstance(v, dict):
        raise _fail(path, "an object of counts per kind", v)
    count = integer(0)
    out = dict.fromkeys(CHECKED_KINDS, 0)
    for k, n in v.items():
        out[str(k)] = count(n, f"{path}.{k}")
    return out


def shard_coords(v: Any, path: str) -> dict[str, int]:
    """Mesh coordinates of a shard: ``{"dp": 0}``."""
    if not isinstance(v, dict) or not all(isinstance(k, str) and _is_int(x) and x >= 0 for k, x in v.items()):
        raise _fail(path, "an object of mesh dimension -> integer >= 0", v)
    return dict(v)


def rank_counts(v: Any, path: str) -> dict[int, int]:
    """Counts per rank: ``{"1": 3}`` (a JSON object's keys are strings) read as ``{1: 3}``."""
    if not isinstance(v, dict):
        raise _fail(path, "an object of rank -> count", v)
    out = {}
    for k, n in v.items():
        if not (isinstance(k, str) and k.isdigit()) or not _is_int(n) or n < 0:
            raise _fail(path, "an object of rank -> count (integers >= 0)", v)
        out[int(k)] = int(n)
    return out


def transient_span(v: Any, path: str) -> dict[str, Any]:
    """``{"first_diverged_step", "last_diverged_step", "names"}``: steps (or null) and tensor names."""
    if not isinstance(v, dict):
        raise _fail(path, 'an object {"first_diverged_step", "last_diverged_step", "names"}', v)
    step = optional(integer())
    first = step(v.get("first_diverged_step"), f"{path}.first_diverged_step")
    last = step(v.get("last_diverged_step"), f"{path}.last_diverged_step")
    names = list_of(string, "strings")(v.get("names", []), f"{path}.names")
    if (first is None) != (last is None) or (first is not None and last is not None and last < first):
        raise _fail(f"{path}.last_diverged_step", "a step >= first_diverged_step (both or neither null)", last)
    return {"first_diverged_step": first, "last_diverged_step": last, "names": names}


def mismatch_list(v: Any, path: str) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise _fail(path, "a list of mismatch objects", v)
    return [validate_mismatch(m, f"{path}[{i}]") for i, m in enumerate(v)]


def rank_hosts(v: Any, path: str) -> dict[str, str]:
    """Global rank (as a string) -> where it runs: ``{"1": "node-7 local_rank=1 cuda:1 GPU-..."}``."""
    if not isinstance(v, dict) or not all(
        isinstance(k, str) and k.isdigit() and isinstance(x, str) for k, x in v.items()
    ):
        raise _fail(path, "an object of rank -> host and device text", v)
    return dict(v)


def checkpoint_entry(v: Any, path: str) -> dict[str, Any]:
    """``{"path", "event": saved|loaded, "status", "saved_step"}`` of an audit at a checkpoint, and at a
    load ``not_compared``: the tensors saved as partitions only (ZeRO-3), which no rank can compare whole."""
    if not isinstance(v, dict):
        raise _fail(path, "an object with path, event and status", v)
    string(v.get("path"), f"{path}.path")
    one_of(("saved", "loaded"))(v.get("event"), f"{path}.event")
    one_of(CHECKPOINT_STATES)(v.get("status"), f"{path}.status")
    optional(integer())(v.get("saved_step"), f"{path}.saved_step")
    optional(integer(0))(v.get("not_compared"), f"{path}.not_compared")
    return dict(v)


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


def blame_entry(v: Any, path: str) -> dict[str, Any]:
    """``{"ranks", "evidence", "cause", "hardware_suspect", "step", "detail"}``; ``ranks: []`` is undecided.

    >>> blame_entry({"ranks": [0], "evidence": "at_rest_change", "hardware_suspect": True}, "blame")["ranks"]
    [0]
    """
    if not isinstance(v, dict):
        raise _fail(path, 'an object {"ranks", "evidence", "hardware_suspect", ...}', v)
    list_of(integer(0), "ranks (integers >= 0)")(v.get("ranks"), f"{path}.ranks")
    one_of(BLAME_EVIDENCE)(v.get("evidence"), f"{path}.evidence")
    boolean(v.get("hardware_suspect"), f"{path}.hardware_suspect")
    optional(integer())(v.get("step"), f"{path}.step")
    for key in ("detail", "cause"):
        optional(string)(v.get(key), f"{path}.{key}")
    return dict(v)


def overlap_entry(v: Any, path: str) -> dict[str, Any]:
    """``{"covers_step", "settled_at", "waited_ms", "audit_ms"}`` (and ``"raced"``) of an overlapped audit."""
    if not isinstance(v, dict):
        raise _fail(path, "an object with covers_step, settled_at, waited_ms and audit_ms", v)
    optional(integer())(v.get("covers_step"), f"{path}.covers_step")
    string(v.get("settled_at"), f"{path}.settled_at")
    for key in ("waited_ms", "audit_ms"):
        optional(number)(v.get(key), f"{path}.{key}")
    optional(boolean)(v.get("raced"), f"{path}.raced")
    return dict(v)


def torchft_entry(v: Any, path: str) -> dict[str, Any]:
    """``{"quorum_id", "group_rank", "point", "replicas", "absent", "healed"}`` (and ``"sync"``) of an audit
    across torchft replica groups (docs/torchft.md)."""
    if not isinstance(v, dict):
        raise _fail(path, "an object with quorum_id, group_rank, point, replicas, absent and healed", v)
    integer()(v.get("quorum_id"), f"{path}.quorum_id")
    integer(0)(v.get("group_rank"), f"{path}.group_rank")
    one_of(("step", "sync"))(v.get("point"), f"{path}.point")
    replicas = v.get("replicas")
    if not isinstance(replicas, dict) or not all(k.isdigit() and isinstance(x, str) for k, x in replicas.items()):
        raise _fail(f"{path}.replicas", "an object of replica rank -> replica id", replicas)
    _RANKS(v.get("absent"), f"{path}.absent")
    healed = v.get("healed")
    if not isinstance(healed, dict) or not all(k.isdigit() and isinstance(x, dict) for k, x in healed.items()):
        raise _fail(f"{path}.healed", "an object of replica rank -> {source, verified, differs}", healed)
    for k, x in healed.items():
        optional(integer(0))(x.get("source"), f"{path}.healed.{k}.source")
        boolean(x.get("verified"), f"{path}.healed.{k}.verified")
    if "sync" in v and not isinstance(v["sync"], dict):
        raise _fail(f"{path}.sync", "an object", v["sync"])
    return dict(v)


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
        raise ReportFormatError(f"{what} must be a JSON object, got {_show(d)}")
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
