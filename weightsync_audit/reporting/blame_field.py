"""The record's ``blame`` field, validated: whom a divergence is blamed on and on what evidence.

>>> blame_entry({"ranks": [0], "evidence": "at_rest_change", "hardware_suspect": True}, "blame")["ranks"]
[0]
"""

from __future__ import annotations

import json
from typing import Any

from weightsync_audit.errors import ReportFormatError

__all__ = ["BLAME_EVIDENCE", "blame_entry"]

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


def _bad(path: str, must: str, v: Any) -> ReportFormatError:
    shown = json.dumps(v, default=repr)
    return ReportFormatError(f"field {path!r} must be {must}, got {shown[:80]}")


def blame_entry(v: Any, path: str) -> dict[str, Any]:
    """``{"ranks", "evidence", "cause", "hardware_suspect", "step", "detail"}``; ``ranks: []`` is undecided."""
    if not isinstance(v, dict):
        raise _bad(path, 'an object {"ranks", "evidence", "hardware_suspect", ...}', v)
    ranks = v.get("ranks")
    if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
        raise _bad(f"{path}.ranks", "a list of ranks (integers >= 0)", ranks)
    if v.get("evidence") not in BLAME_EVIDENCE:
        raise _bad(f"{path}.evidence", f"one of {list(BLAME_EVIDENCE)}", v.get("evidence"))
    if not isinstance(v.get("hardware_suspect"), bool):
        raise _bad(f"{path}.hardware_suspect", "true or false", v.get("hardware_suspect"))
    step = v.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise _bad(f"{path}.step", "a step (integer) or null", step)
    for key in ("detail", "cause"):
        if v.get(key) is not None and not isinstance(v[key], str):
            raise _bad(f"{path}.{key}", "a string or null", v[key])
    return dict(v)
