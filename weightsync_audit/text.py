"""How every message names things: tensors, layers and ranks, worded the same everywhere; and the vote
(:func:`majority`) that decides which ranks a message names as differing, one rule for every layer.

A leaf module: it imports nothing of the package, so errors, the engine, the DDP hints, reporting and
the CLI all share it without an import cycle.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Mapping, Sequence

__all__ = [
    "BEFORE_STEP",
    "COMPARED_NOTES",
    "ENV_VAR",
    "NOTHING_COMPARED",
    "NOTHING_TO_AUDIT",
    "TIE_PREFIX",
    "blame_line",
    "brief_names",
    "dropped_message",
    "fmt_ranks",
    "fmt_shard",
    "is_tie",
    "layer_of",
    "majority",
    "without_tie",
]

#: Openings of the notes that say what an audit could not compare (``check`` prints them).
COMPARED_NOTES = ("no parameters were compared", "no replica to compare", "nothing was compared")

#: The note (and the summary's words) of an audit that compared nothing: every tensor has one holder.
NOTHING_COMPARED = "nothing was compared: no tensor has a replica"

#: The note of an audit that found nothing to compare at all: no tensor of the kinds in ``include``.
NOTHING_TO_AUDIT = "nothing was compared: no tensor to audit"

BEFORE_STEP = "differed as optimizer step"
"""How the ``detail`` of a hyper-parameter that differed at a step, and is equal again when audited, begins
(``differed as optimizer step 3 read it (...)``): the learning rate's hint then speaks of that step."""

TIE_PREFIX = "tie vote"
"""How a mismatch's ``detail`` begins when its reference was decided by a tie, not a majority."""


def is_tie(detail: str | None) -> bool:
    """Whether a mismatch ``detail`` names a tie vote (wherever in the detail it stands).

    >>> is_tie("tie vote: ranks [0, 1] vs ranks [2, 3] hold different values in equal numbers")
    True
    """
    return bool(detail) and TIE_PREFIX + ":" in str(detail)


def without_tie(detail: str | None) -> str | None:
    """A mismatch ``detail`` without its tie words (``None`` when nothing else is left).

    >>> without_tie("gap not measured: late; tie vote: rank 0 vs rank 1, no majority (...)")
    'gap not measured: late'
    """
    if not is_tie(detail):
        return detail
    kept = [p for p in str(detail).split("; ") if not p.startswith(TIE_PREFIX + ":")]
    return "; ".join(kept) or None


def brief_names(names: Iterable[str], limit: int = 6) -> str:
    """The first ``limit`` names, then how many more: how every message lists tensors.

    >>> brief_names(["a", "b", "c"], limit=2)
    'a, b and 1 more'
    """
    names = list(dict.fromkeys(names))  # a tensor named once, however many of its mismatches are listed
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def last_in_sync(first: int | None, last: int | None) -> str:
    """The clause after "first at step ``first``": never ``None``, never the same step said twice.

    >>> last_in_sync(32, 30), last_in_sync(32, None), last_in_sync(32, 32)
    ('last in sync at step 30', 'never seen in sync before', 'in sync at an earlier audit of the same step')
    """
    if last is None:
        return "never seen in sync before"
    if last == first:
        return "in sync at an earlier audit of the same step"
    return f"last in sync at step {last}"


def fmt_gap(x: float | None) -> str:
    """A measured gap in a table or a sentence: ``-`` when not measured."""
    return "-" if x is None else f"{x:.3g}"


def fmt_ranks(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks [1, 3]``.

    >>> fmt_ranks([1, 3])
    'ranks [1, 3]'
    """
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def fmt_shard(shard: Mapping[str, int] | None) -> str:
    """A shard's name from its mesh coordinates; ``""`` for a plain tensor.

    >>> fmt_shard({"dp": 0, "tp": 1})
    'dp=0,tp=1'
    """
    return ",".join(f"{k}={v}" for k, v in shard.items()) if shard else ""


def layer_of(name: str, kind: str) -> str:
    """The module a tensor belongs to: ``backbone`` for ``backbone.weight`` and its optimizer state.

    >>> layer_of("backbone.0.weight.exp_avg", "optimizer"), layer_of("param_groups.1.lr", "optimizer")
    ('backbone.0', 'param_groups.1')
    """
    if kind == "optimizer":
        if name.startswith("param_groups.") or ".param_groups." in name:
            return name.rsplit(".", 1)[0]
        name = name.rsplit(".", 1)[0]  # drop the state key
    return name.rsplit(".", 1)[0] if "." in name else "(root)"


def blame_line(blame: Mapping[str, Any]) -> str:
    """A record's ``blame`` in one line, for ``check``, ``show`` and the printed report.

    >>> blame_line({"ranks": [0], "evidence": "at_rest_change", "cause": "memory at rest",
    ...             "hardware_suspect": True, "detail": "rank 0's w changed"})
    "blame: rank 0 (memory at rest; evidence at_rest_change; HARDWARE SUSPECT): rank 0's w changed"
    """
    ranks = list(blame.get("ranks") or [])
    who = fmt_ranks(ranks) if ranks else "undecided"
    what = [str(blame.get("cause") or "unknown"), f"evidence {blame.get('evidence')}"]
    if blame.get("hardware_suspect"):
        what.append("HARDWARE SUSPECT")
    detail = blame.get("detail")
    return f"blame: {who} ({'; '.join(what)})" + (f": {detail}" if detail else "")


#: The variable that adds the callbacks with no code change (Lightning, the Hugging Face Trainer).
ENV_VAR = "WEIGHTSYNC_AUDIT"


def dropped_message(callback: Any, own: str) -> str:
    """What the callback the variable added says when it steps aside for ``own`` (the explicit callback's
    class name): the options of the variable that are not used, by name.

    >>> class C: env_options = {"every_n_train_steps": 1, "report_path": "a.jsonl"}
    >>> dropped_message(C(), "WeightSyncAudit")  # doctest: +ELLIPSIS
    "...WeightSyncAudit passed in callbacks=..., so the one WEIGHTSYNC_AUDIT adds is not used: its options every_n_train_steps=1, report_path='a.jsonl' are dropped..."
    """
    options = getattr(callback, "env_options", None) or {}
    text = (
        f"weightsync audit: the Trainer already has a {own} passed in callbacks=[...], "
        f"so the one {ENV_VAR} adds is not used"
    )
    if not options:
        return text + " (it had no options)"
    given = ", ".join(f"{k}={v!r}" for k, v in options.items())
    return text + f": its options {given} are dropped (pass them to your callback to have them)"


def majority(values: Sequence[Hashable]) -> tuple[list[int], list[int]]:
    """Split ranks into (reference ranks, differing ranks).

    The reference group is the largest group of equal values; a tie goes to the group holding the
    lowest rank.

    >>> majority([5, 5, 7, 5])
    ([0, 1, 3], [2])
    >>> majority([1, 2])
    ([0], [1])
    """
    groups: dict[Hashable, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    best = min(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))
    ref = set(best)
    return best, [r for r in range(len(values)) if r not in ref]
