"""The JSON the library reads back, with :mod:`.validate` the one validation kit:

- one report line read as JSON, hardened (:func:`loads_record`): never a ``RecursionError`` or a
  giant-integer ``ValueError``; overlong numbers and NaN/Infinity are kept as markers
  (:class:`OversizedNumber`, :class:`NonFinite`) so that the record's validation
  (:func:`~weightsync_audit.reporting.validate.validate_record`) can name the field;
- a checkpoint sidecar (``weightsync-checkpoint/1``), validated on every read (:func:`validate_sidecar`): a
  malformed one is refused naming the field (``resume.ranks["1"]: must be an object ...``), never half-used
  or a bare ``KeyError`` later. Fields are additive: an unknown field is kept; a known one must have its type.

>>> loads_record('{"step": 3}')
{'step': 3}
>>> validate_sidecar({"schema": "weightsync-checkpoint/1", "verdict": "verified", "tensors": {}}, "s.json")
>>> validate_sidecar({"schema": "weightsync-checkpoint/1", "verdict": "verified", "tensors": {},
...                   "resume": {"ranks": {"1": "x"}}}, "s.json")
Traceback (most recent call last):
...
weightsync_audit.reporting.json_line.SidecarError: s.json: field 'resume.ranks["1"]' must be an object of component -> {"digest", "value"?}, got 'x'
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Iterator, Mapping

from weightsync_audit.errors import CheckpointError, ReportFormatError

__all__ = [
    "DIGITS",
    "Check",
    "boolean",
    "entries",
    "fail",
    "integer",
    "is_int",
    "list_of",
    "number",
    "one_of",
    "optional",
    "record_of",
    "shown",
    "string",
    "SIDECAR_SCHEMA",
    "VERDICTS",
    "NonFinite",
    "OversizedNumber",
    "SidecarError",
    "json_skeleton",
    "loads_record",
    "safe_relative",
    "validate_sidecar",
]

_MAX_DIGITS = 40
_MAX_DEPTH = 200
"""Deeper JSON than this is refused before parsing (records nest 4 levels; Python's parser recurses)."""


class NonFinite:
    """``NaN``, ``Infinity`` or ``-Infinity`` in a line: not JSON, kept so the field can be named."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class OversizedNumber(NonFinite):
    """A JSON number too long to be a step or a count, kept as its text (as :class:`NonFinite` keeps its
    word) so the field can be named."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"a number of {len(self.text)} digits"


def _parse_int(text: str) -> int | OversizedNumber:
    return OversizedNumber(text) if len(text) > _MAX_DIGITS else int(text)


def json_skeleton(text: str) -> Iterator[tuple[int, str]]:
    """Each character of JSON ``text`` that lies outside string literals, with its index. The quotes that
    open and close each string are included, so they alternate open, close (an odd count: cut inside one).

    >>> "".join(ch for _, ch in json_skeleton('{"a{": [1, "]"]}'))
    '{"": [1, ""]}'
    """
    in_str = escaped = False
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
                yield i, ch
        else:
            in_str = ch == '"'
            yield i, ch


def _deep_field(text: str, limit: int) -> str | None:
    """The top-level field whose value nests deeper than ``limit``, or ``"(record)"``; None when none does."""
    depth, key, last_str, opened = 0, None, None, None
    for i, ch in json_skeleton(text):
        if ch == '"':
            if opened is None:
                opened = i
            else:
                last_str, opened = text[opened + 1 : i], None
        elif ch == ":" and depth == 1:
            key = last_str
        elif ch in "{[":
            depth += 1
            if depth > limit:
                return key if key is not None else "(record)"
        elif ch in "}]":
            depth -= 1
    return None


def loads_record(text: str) -> Any:
    """``json.loads`` for one report line, hardened: never a ``RecursionError`` or a giant-integer
    ``ValueError``; overlong numbers and NaN/Infinity are kept as markers the validation names.

    Raises ``json.JSONDecodeError`` for text that is not JSON, :class:`ReportFormatError` for nesting.
    """
    if text.count("[") + text.count("{") > _MAX_DEPTH:
        deep = _deep_field(text, _MAX_DEPTH)
        if deep is not None:
            where = "the record" if deep == "(record)" else f"field {deep!r}"
            raise ReportFormatError(f"{where} is nested more than {_MAX_DEPTH} levels deep")
    return json.loads(text, parse_int=_parse_int, parse_constant=NonFinite)


# -- the checks every read field goes through ----------------------------------------------------------

_INT_LIMIT = 2**63  # steps, counts and ranks are int64 everywhere else
Check = Callable[[Any, str], Any]
"""``check(value, field_path)`` returns the value to keep, or raises ReportFormatError."""


def shown(v: Any) -> str:
    """A short, safe rendering of any value for a message (huge, deep or odd values included)."""
    try:
        if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
            return f"an integer of {v.bit_length()} bits"
        text = repr(v)
    except Exception:  # noqa: BLE001 - RecursionError, ValueError on giant ints: describe it instead
        return f"a {type(v).__name__} too deep or too large to show"
    return text if len(text) <= 80 else text[:77] + "..."


def fail(path: str, must: str, v: Any) -> ReportFormatError:
    return ReportFormatError(f"field {path!r} must be {must}, got {shown(v)}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -_INT_LIMIT < v < _INT_LIMIT


def integer(minimum: int | None = None) -> Check:
    must = "an integer" + ("" if minimum is None else f" >= {minimum}")

    def check(v: Any, path: str) -> int:
        if not is_int(v) or (minimum is not None and v < minimum):
            raise fail(path, must, v)
        return int(v)

    return check


def number(v: Any, path: str) -> float:
    """A finite number >= 0 (a gap, a duration)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise fail(path, "a finite number >= 0", v)
    try:
        x = float(v)
    except OverflowError:
        raise fail(path, "a finite number >= 0", v) from None
    if not math.isfinite(x) or x < 0:
        raise fail(path, "a finite number >= 0", v)
    return x


def string(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise fail(path, "a string", v)
    return v


def boolean(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise fail(path, "true or false", v)
    return v


def one_of(choices: tuple[str, ...]) -> Check:
    def check(v: Any, path: str) -> str:
        if not isinstance(v, str) or v not in choices:
            raise fail(path, f"one of {list(choices)}", v)
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
            raise fail(path, f"a list of {what}", v)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(inner(x, f"{path}[{i}]"))
            except ReportFormatError:
                raise fail(path, f"a list of {what}", v) from None
        return out

    return check


def record_of(must: str, required: Mapping[str, Check], present: Mapping[str, Check] | None = None) -> Check:
    """An object (returned as a copy) whose ``required`` fields each pass their check (a missing one is
    checked as null) and whose ``present`` fields pass theirs where they are there."""

    def check(v: Any, path: str) -> dict[str, Any]:
        if not isinstance(v, Mapping):
            raise fail(path, must, v)
        for key, inner in required.items():
            inner(v.get(key), f"{path}.{key}" if path else key)
        for key, inner in (present or {}).items():
            if key in v:
                inner(v[key], f"{path}.{key}" if path else key)
        return dict(v)

    return check


DIGITS = re.compile(r"\d+")
"""The keys of an object by rank (a JSON object's keys are strings)."""


def entries(item: Check, must: str, keys: re.Pattern[str] | None = None) -> Check:
    """An object (returned as a copy) whose every value passes ``item`` (each named ``field['key']``) and,
    with ``keys``, whose every key matches it."""

    def check(v: Any, path: str) -> dict[str, Any]:
        if not isinstance(v, Mapping) or (keys is not None and not all(keys.fullmatch(str(k)) for k in v)):
            raise fail(path, must, v)
        for k, x in v.items():
            item(x, f"{path}[{k!r}]")
        return dict(v)

    return check


# -- a checkpoint sidecar ----------------------------------------------------------------------------------

SIDECAR_SCHEMA = "weightsync-checkpoint/1"
VERDICTS = ("verified", "diverged", "sampled")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_RANK = re.compile(r"\d{1,9}")


class SidecarError(CheckpointError):
    """A sidecar that cannot be read or is not a valid ``weightsync-checkpoint/1`` object; the message names
    the file and the field."""


def safe_relative(name: str) -> bool:
    """A path inside the checkpoint's folder: relative, no ``..``, no empty part (a sidecar never makes
    ``verify`` read a file outside the checkpoint it describes)."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and all(p not in ("", ".", "..") for p in parts)


def _hex16(v: Any, path: str) -> str:
    if not isinstance(v, str) or not _HEX16.fullmatch(v):
        raise fail(path, "16 hex digits", v)
    return v


def _epoch(v: Any, path: str) -> Any:
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise fail(path, "a number or null", v)
    return v


_INTS = list_of(integer(), "integers")
_TENSORS = entries(
    record_of('an object {"digest", "dtype", "shape"}', {"digest": _hex16, "shape": _INTS},
              {"dtype": string, "offset": _INTS, "global_shape": _INTS}),
    "an object of name -> digest",
)  # fmt: skip


def _files(rank: bool) -> Check:
    """A sidecar's ``files`` (``shards``, with ``rank``): file -> size and digest, every file inside the checkpoint."""
    each = entries(
        record_of('an object {"bytes", "digest"}', {"bytes": integer(0), "digest": _hex16, **({"rank": integer(0)} if rank else {})}),
        "an object of file -> size and digest",
    )  # fmt: skip

    def check(v: Any, path: str) -> Any:
        for name in v if isinstance(v, Mapping) else ():
            if not safe_relative(str(name)):
                raise ReportFormatError(f"field {path!r} names {name!r}, which is not a path inside the checkpoint")
        return each(v, path)

    return check


_COMPONENT = record_of('an object {"digest", "value"?}', {"digest": string})


def _resume_ranks(v: Any, path: str) -> Any:
    if not isinstance(v, Mapping):
        raise fail(path, "an object of rank -> state", v)
    for r, comps in v.items():
        if not _RANK.fullmatch(str(r)):
            raise ReportFormatError(f"field {path!r} has the key {r!r}, which is not a rank number")
        where = f'{path}["{r}"]'
        if not isinstance(comps, Mapping):
            raise fail(where, 'an object of component -> {"digest", "value"?}', comps)
        for comp, e in comps.items():
            _COMPONENT(e, f"{where}.{comp}")
    return v


_SIDECAR = record_of(
    "an object",
    {"tensors": _TENSORS, "step": optional(integer(0)), "epoch": _epoch},
    {
        "checkpoint": string, "time": string, "coverage": string, "world_size": integer(1),
        "diverged": list_of(string, "strings"), "partitioned": list_of(string, "strings"),
        "tied": entries(string, "an object of name -> name"),
        "rank_tensors": entries(_TENSORS, "an object of rank -> tensors"),
        "shards": _files(rank=True), "files": _files(rank=False),
        "resume": record_of('an object {"ranks"}', {"ranks": _resume_ranks}),
    },
)  # fmt: skip


def validate_sidecar(data: Any, where: str) -> None:
    """Raise :class:`SidecarError` naming ``where`` (the file) and the first malformed field of ``data``."""
    try:
        if not isinstance(data, Mapping):
            raise fail("(sidecar)", f"a {SIDECAR_SCHEMA} object", data)
        if data.get("schema") != SIDECAR_SCHEMA:
            raise ReportFormatError(f"not a {SIDECAR_SCHEMA} sidecar (field 'schema' is {data.get('schema')!r})")
        if data.get("verdict") not in VERDICTS:
            raise ReportFormatError(f"field 'verdict' must be one of {list(VERDICTS)}, not {data.get('verdict')!r}")
        _SIDECAR(data, "")
    except ReportFormatError as exc:
        raise SidecarError(f"{where}: {exc}") from None
