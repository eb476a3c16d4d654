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
weightsync_audit.reporting.json_line.SidecarError: s.json: field 'resume.ranks["1"]' must be an object of component -> {"digest", "value"?}, not a string
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterator, Mapping

from weightsync_audit.errors import CheckpointError, ReportFormatError

__all__ = [
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


class OversizedNumber:
    """A JSON number too long to be a step or a count, kept as its text so the field can be named."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"a number of {len(self.text)} digits"


class NonFinite:
    """``NaN``, ``Infinity`` or ``-Infinity`` in a line: not JSON, kept so the field can be named."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


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


# -- a checkpoint sidecar ----------------------------------------------------------------------------------

SIDECAR_SCHEMA = "weightsync-checkpoint/1"
VERDICTS = ("verified", "diverged", "sampled")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_RANK = re.compile(r"\d{1,9}")


class SidecarError(CheckpointError):
    """A sidecar that cannot be read or is not a valid ``weightsync-checkpoint/1`` object; the message names
    the file and the field."""


def _kind(v: Any) -> str:
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list"}
    return "null" if v is None else names.get(type(v), "an object" if isinstance(v, Mapping) else type(v).__name__)


class _Check:
    """Type checks that name the field: ``where`` is the sidecar file, ``field`` the path inside it."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, must: str, v: Any) -> SidecarError:
        got = repr(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else _kind(v)
        return SidecarError(f"{self.where}: field {field!r} must be {must}, not {got}")

    def int_(self, v: Any, field: str, *, none: bool = False, low: int = 0) -> None:
        if v is None and none:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise self.fail(field, f"an integer >= {low}" + (" or null" if none else ""), v)

    def str_(self, v: Any, field: str, *, hex16: bool = False) -> None:
        if not isinstance(v, str) or (hex16 and not _HEX16.fullmatch(v)):
            raise self.fail(field, "16 hex digits" if hex16 else "a string", v)

    def obj(self, v: Any, field: str, must: str) -> Mapping[str, Any]:
        if not isinstance(v, Mapping):
            raise self.fail(field, must, v)
        return v

    def each(self, v: Any, field: str, must: str, item: Callable[[Any, str], None]) -> None:
        for k, x in self.obj(v, field, must).items():
            item(x, f"{field}[{k!r}]")

    def strings(self, v: Any, field: str) -> None:
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.fail(field, "a list of strings", v)

    def ints(self, v: Any, field: str) -> None:
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise self.fail(field, "a list of integers", v)


def safe_relative(name: str) -> bool:
    """A path inside the checkpoint's folder: relative, no ``..``, no empty part (a sidecar never makes
    ``verify`` read a file outside the checkpoint it describes)."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and all(p not in ("", ".", "..") for p in parts)


def _tensors(c: _Check, v: Any, field: str) -> None:
    def entry(e: Any, where: str) -> None:
        e = c.obj(e, where, 'an object {"digest", "dtype", "shape"}')
        c.str_(e.get("digest"), f"{where}.digest", hex16=True)
        c.ints(e.get("shape"), f"{where}.shape")
        if "dtype" in e:
            c.str_(e["dtype"], f"{where}.dtype")
        for key in ("offset", "global_shape"):
            if key in e:
                c.ints(e[key], f"{where}.{key}")

    c.each(v, field, "an object of name -> digest", entry)


def _files(c: _Check, v: Any, field: str, *, rank: bool) -> None:
    def entry(e: Any, where: str) -> None:
        e = c.obj(e, where, 'an object {"bytes", "digest"}')
        c.int_(e.get("bytes"), f"{where}.bytes")
        c.str_(e.get("digest"), f"{where}.digest", hex16=True)
        if rank:
            c.int_(e.get("rank"), f"{where}.rank")

    for name in c.obj(v, field, "an object of file -> size and digest"):
        if not safe_relative(str(name)):
            raise SidecarError(f"{c.where}: field {field!r} names {name!r}, which is not a path inside the checkpoint")
    c.each(v, field, "an object of file -> size and digest", entry)


def _resume(c: _Check, v: Any, field: str) -> None:
    ranks = c.obj(c.obj(v, field, 'an object {"ranks"}').get("ranks"), f"{field}.ranks", "an object of rank -> state")
    for r, comps in ranks.items():
        where = f'{field}.ranks["{r}"]'
        if not _RANK.fullmatch(str(r)):
            raise SidecarError(f"{c.where}: field '{field}.ranks' has the key {r!r}, which is not a rank number")
        for comp, e in c.obj(comps, where, 'an object of component -> {"digest", "value"?}').items():
            e = c.obj(e, f"{where}.{comp}", 'an object {"digest", "value"?}')
            c.str_(e.get("digest"), f"{where}.{comp}.digest")


def validate_sidecar(data: Any, where: str) -> None:
    """Raise :class:`SidecarError` naming ``where`` (the file) and the first malformed field of ``data``."""
    c = _Check(where)
    data = c.obj(data, "(sidecar)", f"a {SIDECAR_SCHEMA} object")
    if data.get("schema") != SIDECAR_SCHEMA:
        raise SidecarError(f"{where}: not a {SIDECAR_SCHEMA} sidecar (field 'schema' is {data.get('schema')!r})")
    if data.get("verdict") not in VERDICTS:
        raise SidecarError(f"{where}: field 'verdict' must be one of {list(VERDICTS)}, not {data.get('verdict')!r}")
    _tensors(c, data.get("tensors"), "tensors")
    for key in ("checkpoint", "time", "coverage"):
        if key in data:
            c.str_(data[key], key)
    c.int_(data.get("step"), "step", none=True)
    if data.get("epoch") is not None and (
        isinstance(data["epoch"], bool) or not isinstance(data["epoch"], (int, float))
    ):
        raise c.fail("epoch", "a number or null", data["epoch"])
    if "world_size" in data:
        c.int_(data["world_size"], "world_size", low=1)
    for key in ("diverged", "partitioned"):
        if key in data:
            c.strings(data[key], key)
    if "tied" in data:
        c.each(data["tied"], "tied", "an object of name -> name", lambda v, f: c.str_(v, f))
    if "rank_tensors" in data:
        c.each(data["rank_tensors"], "rank_tensors", "an object of rank -> tensors", lambda v, f: _tensors(c, v, f))
    if "shards" in data:
        _files(c, data["shards"], "shards", rank=True)
    if "files" in data:
        _files(c, data["files"], "files", rank=False)
    if "resume" in data:
        _resume(c, data["resume"], "resume")
