"""Resync where some tensors are held by some ranks only by declaration (pipeline stages, expert groups).

Ranks of different stages hold different tensors, so the world-wide broadcast of one source cannot serve
them. Instead every rank describes what it holds (the audit's structure rows: name, dtype, shape, digest,
replica key and declared group), the coordinator plans the copies once (:func:`plan_held_copies`), and every
rank makes the same copies in the same order over the data plane:

- each tensor is copied only within its replica group (a declared stage's or expert group's ranks; a plain
  tensor's group is every rank; a DTensor's, its peer set), from ``src`` when ``src`` holds it, else from
  the rank holding the group's reference (majority) value, a tie going to the lowest rank;
- only the holders whose digest differs from their source's receive anything;
- a tensor whose structure differs within its group (missing on a member, another shape or dtype) is
  refused on every rank alike before anything moves, and the error names it.

Python values (learning rates, integer steps) travel in the plan as literals and are read back with
``ast.literal_eval`` (never executed). Every rank ends together: the transfers close with the data plane's
agreed result (:func:`~weightsync_audit.engine.repair.resync_transfer.move_copies`).

>>> rows = [[["param", "w", "float32", [2], 5, "holders:stage", 7, [0, 2], None]],
...         [["param", "v", "float32", [2], 1, "holders:stage", 9, [1, 3], None]],
...         [["param", "w", "float32", [2], 6, "holders:stage", 7, [0, 2], None]],
...         [["param", "v", "float32", [2], 1, "holders:stage", 9, [1, 3], None]]]
>>> plan_held_copies(rows, src=0)["copies"]
[['param:w', 0, [2], 'float32', [2]]]
"""

from __future__ import annotations

import ast
import json
from typing import Any, Callable, Sequence

import torch

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.agreement.consensus import majority_within
from weightsync_audit.engine.hashing.digest import digest_entries
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.engine.inventory.peers import ALL, carriers, peer_sets, replica_groups
from weightsync_audit.engine.inventory.replicas.keys import FOUND, is_holders
from weightsync_audit.engine.repair.resync_transfer import move_copies
from weightsync_audit.text import fmt_ranks

__all__ = ["Row", "plan_held_copies", "resync_held"]


def _is_value(e: Entry) -> bool:
    return e.container is not None and not isinstance(e.container[e.key], torch.Tensor)


Row = list[Any]
"""One rank's view of a tensor: ``[kind, name, dtype, shape, digest, layout, key, members, literal]`` (layout
``""`` and key ``ALL`` for a plain tensor; members: the declared group as positions; literal: a Python
value's ``repr``, else ``None``)."""


def _row(e: Entry, digest: int, global_ranks: Sequence[int]) -> Row:
    where = {int(g): i for i, g in enumerate(global_ranks)}
    info = e.shard
    named = info.members if info is not None else ()
    members = [-1] if named == FOUND else [where[int(g)] for g in named if int(g) in where]
    literal = repr(e.container[e.key]) if _is_value(e) else None
    layout, key = ("", ALL) if info is None else (info.layout, info.key)
    return [e.kind, e.name, e.dtype, list(e.shape), int(digest), layout, int(key), members, literal]


def _groups(
    rows: list[Row | None], world: int, found: dict[int, set[int]]
) -> tuple[list[tuple[list[int], list[int]]], str | None]:
    """The replica groups of one tensor from every rank's row (``None``: not held), or why it has none."""
    held = [r for r in range(world) if rows[r] is not None]
    keys = [None if row is None else int(row[6]) for row in rows]
    members = [tuple(row[7]) if row is not None else () for row in rows]
    if all(is_holders(str(rows[r][5])) for r in held) and (len(held) < world or any(members)):  # type: ignore[index]
        return replica_groups(keys, members, found), None
    if len(held) < world:
        return [], f"missing on {fmt_ranks([r for r in range(world) if r not in held])}"
    return [(s, s) for s in peer_sets([int(k) for k in keys]) if len(s) > 1], None  # type: ignore[arg-type]


def _literal(text: str) -> str | None:
    """Why ``text`` cannot be installed as a Python value, else ``None``."""
    try:
        ast.literal_eval(text)  # literals only: never executes code
    except (ValueError, SyntaxError):
        return f"its value {text[:80]!r} is not a Python literal"
    return None


def plan_held_copies(manifests: Sequence[Sequence[Row]], src: int) -> dict[str, Any]:
    """The copies that make every replica group agree, planned once from every rank's rows (:data:`Row`):
    ``{"copies": [[uid, source, receivers, dtype, shape]], "values": [[uid, source, receivers, literal]],
    "refused": [why]}``, ranks as positions, in one order (the first-seen order of the tensors)."""
    world = len(manifests)
    by_rank = [{f"{row[0]}:{row[1]}": row for row in rows} for rows in manifests]
    order = list(dict.fromkeys(uid for d in by_rank for uid in d))
    found = carriers([((row[6], row[7]) for row in rows) for rows in manifests])
    out: dict[str, list[Any]] = {"copies": [], "values": [], "refused": []}
    for uid in order:
        rows = [d.get(uid) for d in by_rank]
        groups, why = _groups(rows, world, found)
        if why is not None:
            out["refused"].append(f"{uid} {why}")
        for holders, group in groups:
            sigs = [None if rows[r] is None else (rows[r][2], list(rows[r][3]), rows[r][6]) for r in group]  # type: ignore[index]
            if any(sig != sigs[0] for sig in sigs):
                out["refused"].append(f"{uid} differs in structure within its replica group {fmt_ranks(group)}")
                continue
            digests = [rows[r][4] if r in holders else None for r in range(world)]  # type: ignore[index]
            source = src if src in holders else majority_within(digests, holders)[0][0]
            receivers = [r for r in holders if r != source and digests[r] != digests[source]]
            row = rows[source]
            if not receivers or row is None:
                continue
            if row[8] is None:
                out["copies"].append([uid, source, receivers, row[2], list(row[3])])
            elif (bad := _literal(row[8])) is not None:
                out["refused"].append(f"{uid}: {bad}")
            else:
                out["values"].append([uid, source, receivers, row[8]])
    return out


def _plan_rule(src: int) -> Callable[[list[bytes]], bytes]:
    def rule(parts: list[bytes]) -> bytes:
        return json.dumps(plan_held_copies([json.loads(p) for p in parts], src)).encode()

    return rule


def resync_held(comm: Comm, entries: Sequence[Entry], src: int) -> None:
    """Make every replica group of ``entries`` (this rank's, held by design or not) agree; collective over
    ``comm``. Raises ``ValueError`` on every rank alike, before anything moves, when some tensor's structure
    differs within its group."""
    entries = [e for e in entries if e.dtype != "none"]
    digests = digest_entries(entries).tolist()
    rows = [_row(e, d, comm.global_ranks) for e, d in zip(entries, digests)]
    plan = json.loads(comm.decide(json.dumps(rows).encode(), _plan_rule(src), "the resync plan"))
    if plan["refused"]:
        raise ValueError(
            "cannot resync: some tensors differ in structure within their replica group, not only in values: "
            + "; ".join(plan["refused"][:10])
        )
    mine = {e.uid: e for e in entries}
    copies = []
    for uid, source, receivers, dtype, shape in plan["copies"]:
        e = mine.get(uid)
        # A rank outside the group moves nothing, but counts the bytes alike (the deadlines agree).
        t = e.tensor if e is not None else torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        copies.append((uid.split(":", 1)[1], t, int(source), [int(r) for r in receivers]))
    if copies:
        move_copies(comm, src, copies)
    for uid, _, receivers, literal in plan["values"]:
        if comm.rank in receivers:
            e = mine[uid]
            e.container[e.key] = ast.literal_eval(literal)  # checked a literal by the plan: never executes
