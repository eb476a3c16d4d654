"""One report line read as JSON, hardened: never a ``RecursionError`` or a giant-integer ``ValueError``;
overlong numbers and NaN/Infinity are kept as markers (:class:`OversizedNumber`, :class:`NonFinite`) so
that the validation (:mod:`weightsync_audit.reporting.validate`) can name the field.

>>> loads_record('{"step": 3}')
{'step': 3}
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from weightsync_audit.errors import ReportFormatError

__all__ = ["NonFinite", "OversizedNumber", "json_skeleton", "loads_record"]

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
