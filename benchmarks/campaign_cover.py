"""The combination campaign's plan: its factors, the pairs that cannot be built, and a seeded all-pairs design.

Every value of every factor meets every value of every other factor in at least one row (a 2-wise covering
array), except the pairs that cannot be built: a training convention that does not exist
(:data:`NOT_APPLICABLE`, with its reason) or a pair of options the library refuses at construction (found by
probing the adapters, :mod:`campaign_probe`). The design is greedy (AETG-like): each row starts from a pair
not covered yet and fills the other factors with the values that cover the most new pairs; ties are broken
by a ``random.Random(seed)``, so the same seed gives the same rows.

>>> rows = all_pairs({"a": (0, 1), "b": ("x", "y"), "c": (True, False)}, seed=0)
>>> len(rows) >= 4 and not uncovered({"a": (0, 1), "b": ("x", "y"), "c": (True, False)}, rows)
True
"""

from __future__ import annotations

import random
from itertools import combinations
from typing import Any, Iterable, Mapping, Sequence

Factors = Mapping[str, Sequence[Any]]
Row = dict[str, Any]
Pair = tuple[tuple[str, Any], tuple[str, Any]]

FACTORS: dict[str, tuple[Any, ...]] = {
    "adapter": ("loop", "lightning", "hf"),
    "optimizer": ("adam_fused", "adam_foreach", "adam_single", "sgd_momentum", "lbfgs"),
    "pattern": ("plain", "accumulate", "scaler", "clip", "scheduler", "ema", "clamp", "frozen", "groups"),
    "fault": ("flip", "write", "lr", "compute"),
    "world": (2, 3),
    "attribution": (False, True),
    "overlap": (False, True),
    "on_mismatch": ("warn", "raise", "resync"),
    "pinpoint": (False, True),
    "coverage": ("1", "1/4"),
    "tolerance": (None, 1e-6),
    "check_batches": (False, True),
    "grads": (False, True),
}
"""The campaign's factors. ``adapter``: LoopAudit over a plain DDP loop, the Lightning callback in a real
``Trainer`` (strategy ddp), the Hugging Face callback in a real ``Trainer``. ``optimizer`` and ``pattern``:
the training conventions (:mod:`campaign_train`). ``fault``: what the faulty runs of the row plant (on rank 0
in one run, on rank 1 in another): one bit flipped at rest, a whole tensor rewritten at rest (software),
the learning rate x10 on one rank for one step, one element scaled by 1 + 2**-10 inside the optimizer's update (a compute fault). ``world``: 2
ranks (a tie: only attribution can name the rank) or 3 (a majority). The rest are the audit's options."""

OPTIONS = ("attribution", "overlap", "on_mismatch", "pinpoint", "coverage", "tolerance", "check_batches", "grads")
"""The factors that are the library's options (the others are the training run and the fault)."""

NOT_APPLICABLE: dict[Pair, str] = {
    (("adapter", "hf"), ("optimizer", "lbfgs")): "the Hugging Face Trainer steps its optimizer without a closure",
    (("optimizer", "lbfgs"), ("pattern", "scaler")): "torch's GradScaler does not take a closure optimizer",
    (("optimizer", "lbfgs"), ("pattern", "groups")): "torch's LBFGS takes one parameter group only",
}
"""Pairs that no training run can hold (a convention that does not exist), with the reason."""


def pair(a: tuple[str, Any], b: tuple[str, Any], order: Sequence[str]) -> Pair:
    """``(a, b)`` in the factors' order, so each pair has one spelling."""
    return (a, b) if order.index(a[0]) < order.index(b[0]) else (b, a)


def all_pair_set(factors: Factors, excluded: Iterable[Pair] = ()) -> set[Pair]:
    """Every pair of values of two different factors, but ``excluded``."""
    out = {((f, a), (g, b)) for f, g in combinations(factors, 2) for a in factors[f] for b in factors[g]}
    return out - set(excluded)


def _allowed(row: Row, factor: str, value: Any, excluded: set[Pair], order: Sequence[str]) -> bool:
    return all(pair((f, v), (factor, value), order) not in excluded for f, v in row.items())


def _gain(row: Row, factor: str, value: Any, todo: set[Pair], order: Sequence[str]) -> int:
    return sum(pair((f, v), (factor, value), order) in todo for f, v in row.items())


def _candidate(factors: Factors, start: Pair, todo: set[Pair], excluded: set[Pair], rng: random.Random) -> Row | None:
    order = list(factors)
    row: Row = dict(start)
    rest = [f for f in order if f not in row]
    rng.shuffle(rest)
    for f in rest:
        options = [v for v in factors[f] if _allowed(row, f, v, excluded, order)]
        if not options:
            return None
        best = max(_gain(row, f, v, todo, order) for v in options)
        row[f] = rng.choice([v for v in options if _gain(row, f, v, todo, order) == best])
    return {f: row[f] for f in order}


def row_pairs(row: Row, order: Sequence[str]) -> set[Pair]:
    """The pairs one row covers."""
    return {pair((f, row[f]), (g, row[g]), order) for f, g in combinations(order, 2)}


def all_pairs(factors: Factors, excluded: Iterable[Pair] = (), *, seed: int = 0, tries: int = 24) -> list[Row]:
    """A seeded greedy all-pairs design over ``factors`` that never puts an ``excluded`` pair in a row."""
    order = list(factors)
    banned = {pair(a, b, order) for a, b in excluded}
    todo = all_pair_set(factors, banned)
    rng = random.Random(seed)
    rows: list[Row] = []
    while todo:
        ranked = sorted(todo, key=repr)
        best: tuple[int, Row] | None = None
        for _ in range(tries):
            row = _candidate(factors, rng.choice(ranked), todo, banned, rng)
            if row is not None:
                gain = len(row_pairs(row, order) & todo)
                if best is None or gain > best[0]:
                    best = (gain, row)
        if best is None:
            raise ValueError(f"no row can hold the pairs left, e.g. {ranked[0]}: too many excluded pairs")
        rows.append(best[1])
        todo -= row_pairs(best[1], order)
    return rows


def uncovered(factors: Factors, rows: Sequence[Row], excluded: Iterable[Pair] = ()) -> set[Pair]:
    """The pairs of ``factors`` (but ``excluded``) that no row of ``rows`` covers."""
    order = list(factors)
    todo = all_pair_set(factors, {pair(a, b, order) for a, b in excluded})
    for row in rows:
        todo -= row_pairs(row, order)
    return todo


def each_value_once(factors: Factors, rows: Sequence[Row]) -> list[int]:
    """Indices of a few rows of ``rows`` in which every value of every factor appears at least once (greedy,
    deterministic): the CI slice, a subset of the full design."""
    todo = {(f, v) for f in factors for v in factors[f]}
    picked: list[int] = []
    while todo:
        gains = [len({(f, r[f]) for f in factors} & todo) for r in rows]
        i = max(range(len(rows)), key=lambda k: (gains[k], -k))
        if gains[i] == 0:
            break  # a value no row holds (every pair of it excluded): nothing more to gain
        picked.append(i)
        todo -= {(f, rows[i][f]) for f in factors}
    return sorted(picked)


FOCUS: dict[str, dict[str, Any]] = {
    "issue 41 item 1 (resync with attribution, a second fault)": {"attribution": True, "on_mismatch": "resync"},
    "item 2 (overlap + resync + attribution)": {"attribution": True, "overlap": True, "on_mismatch": "resync"},
    "item 4 (LBFGS with attribution)": {"optimizer": "lbfgs", "attribution": True, "fault": "compute"},
    "item 5 (Lightning accumulate_grad_batches, attribution)": {"adapter": "lightning", "pattern": "accumulate",
                                                                "attribution": True},
    "item 6 (GradScaler + fused Adam, attribution)": {"optimizer": "adam_fused", "pattern": "scaler",
                                                      "attribution": True, "fault": "compute"},
    "item 7 (a whole-tensor write, attribution)": {"fault": "write", "attribution": True},
    "item 8 (check_batches with overlap)": {"check_batches": True, "overlap": True},
    "item 9 (a clamp inside an overlapped audit's window)": {"pattern": "clamp", "overlap": True},
    "issue 48 item 2 (LoopAudit include grads: a gradient changed on one rank after the all-reduce)": {
        "fault": "grad", "grads": True},
    "the same with overlap and attribution": {"fault": "grad", "grads": True, "overlap": True, "attribution": True},
}  # fmt: skip
"""Rows added to the full design for the three-way interactions issue 41 names (a pairwise design covers each
of their pairs, not necessarily all three at once): the other factors at their first value, 2 ranks."""


FOCUS_ONLY: dict[str, tuple[Any, ...]] = {"fault": ("grad",)}
"""Values only the focus rows take (not in the all-pairs design): ``grad``, one element of one gradient scaled
by 1 + 2**-10 on one rank after the all-reduce, before the optimizer step (what ``include`` grads must see)."""


def focus_rows() -> list[Row]:
    """The :data:`FOCUS` rows, completed with each factor's first value."""
    return [{f: spec.get(f, values[0]) for f, values in FACTORS.items()} for spec in FOCUS.values()]
