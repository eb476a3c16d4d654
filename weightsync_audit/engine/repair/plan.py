"""What a resync does, decided before anything moves: its source per tensor, what it reads, and its copies.

**The source** (:func:`plan_resync`, a pure function of the identical audit record). ``resync_src`` is a
rank or ``"majority"``. With ``"majority"`` every tensor comes from a rank holding its reference value.
With a rank, that rank is the source for every tensor it holds the reference value of; for a tensor where
it holds a minority value (the others outvote it), the tensor is taken from a rank holding the majority
value instead, and a note says so: copying a minority value over the majority would spread the
divergence. A tie has no majority: the chosen rank (or, for ``"majority"``, the side holding the lowest
rank) decides, and the note names the tie. A source is never a rank whose copy holds NaN or inf
(``Mismatch.nonfinite``) where another rank's copy is finite; when no copy is finite,
:class:`~weightsync_audit.ResyncError` names the tensors, and nothing moves. Gradients that differ are
resynced too (``ResyncPlan.grads``), so that the step about to be taken is the same everywhere.

**What it reads** (:class:`ResyncState`): the audit channel, the model and optimizers, and their manifest
under each engine's replica rules. Right after an audit the auditor hands over its channel and the manifest
that audit built (:meth:`Auditor.resync_state <weightsync_audit.engine.auditor.Auditor.resync_state>`); the
standalone :func:`~weightsync_audit.engine.repair.resync.resync` prepares the same (:func:`prepare_resync`).
The audit's manifest may leave out what it was told not to compare; what it reported differing it holds
exactly as a resync's own would, so a resync of those names reads it, and of any other name builds its own.

**The copies** (:func:`plan_copies`, run once by the coordinator over every rank's :class:`Holding` rows,
in one round): plain tensors, tensors held by some ranks by design (pipeline stages, expert groups, an
engine's ``holders:`` layouts) and DTensor shards alike. Each tensor is copied only within its replica
group (a plain tensor's is every rank, a shard's its peer set, a declared layout's its holders), from the
chosen source when it holds it, else from the group's majority holder (a tie going to the lowest rank), to
the holders whose digest differs. A tensor whose structure differs within its group is refused on every
rank alike before anything moves; optimizer state that differs in structure is first given the source's
structure (``install``). Python values travel as literals, read back with ``ast.literal_eval`` (never
executed). Every rank makes the same copies in the same order.

>>> from weightsync_audit.reporting.record import Mismatch
>>> plan = plan_resync([Mismatch("w", "param", ranks=[0], reference_ranks=[1, 2])], 0)
>>> plan.sources, plan.notes[0][:46]
({1: ['w']}, 'resync_src=0 holds a minority value of w (rank')
>>> rows = [[Holding("param", "w", "float32", (2,), 5)], [Holding("param", "w", "float32", (2,), 6)]]
>>> plan_copies(rows, 0)["copies"]
[['param:w', 0, [1], 'float32', [2]]]
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Mapping, Sequence, Union

import torch
from torch import nn

from weightsync_audit.channel.star import Comm
from weightsync_audit.compat_engines import MASTER_CHECK, STATE_CHECK
from weightsync_audit.engine.agreement.consensus import majority_within
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest
from weightsync_audit.engine.inventory.manifest import Entry, as_optimizers
from weightsync_audit.engine.inventory.peers import ALL, FOUND, carriers, is_holders, peer_sets, replica_groups
from weightsync_audit.engine.inventory.replicas import replica_manifest, stage_module
from weightsync_audit.errors import ResyncError
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import brief_names, fmt_ranks

__all__ = [
    "DERIVED",
    "RESYNC_KINDS",
    "Holding",
    "ResyncPlan",
    "ResyncSource",
    "ResyncState",
    "check_resync_src",
    "is_derived",
    "plan_copies",
    "plan_resync",
    "prepare_resync",
]

DERIVED = frozenset({MASTER_CHECK})
"""Entries that are checks drawn from other tensors, not tensors of their own: never copied (resyncing the
tensors they are drawn from restores them, which the confirming audit reads again)."""


def is_derived(name: str) -> bool:
    """Whether ``name`` is a check drawn from other tensors (:data:`DERIVED`, or an FSDP1
    ``fsdp1.optimizer_state_held.<parameter>``), never copied by a resync.

    >>> is_derived("fsdp1.optimizer_state_held.0.weight"), is_derived("0.weight")
    (True, False)
    """
    return name in DERIVED or name.startswith(STATE_CHECK + ".")


ResyncSource = Union[int, Literal["majority"]]
"""A rank of the group, or ``"majority"``: each tensor from a rank holding its reference value."""


def check_resync_src(src: object, argument: str = "resync_src") -> ResyncSource:
    """Validate a resync source: an integer rank >= 0 or ``"majority"``."""
    if src == "majority" and isinstance(src, str):
        return "majority"
    if isinstance(src, bool) or not isinstance(src, int) or src < 0:
        raise ValueError(f"{argument}={src!r}: must be a rank number >= 0 or 'majority'")
    return src


@dataclass(slots=True)
class ResyncPlan:
    """Source rank -> names to broadcast from it (ascending ranks), and what the record should say."""

    sources: dict[int, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    grads: dict[int, list[str]] = field(default_factory=dict)
    """Source rank -> parameters whose gradients are broadcast from it."""

    def describe(self) -> str:
        """``3 tensor(s) from rank 0, 1 from rank 2`` (gradients counted as tensors too)."""
        parts = []
        for r in self.ranks():
            n, g = len(self.sources.get(r, ())), len(self.grads.get(r, ()))
            parts.append(f"{n + g} from rank {r}" + (f" ({g} gradient(s))" if g else ""))
        total = sum(len(n) for n in self.sources.values()) + sum(len(n) for n in self.grads.values())
        return f"{total} tensor(s): " + ", ".join(parts) if parts else "nothing"

    def ranks(self) -> list[int]:
        """Every source rank, ascending (the order of the broadcasts)."""
        return sorted(set(self.sources) | set(self.grads))

    def receivers(self, mismatches: Sequence[Mismatch]) -> list[int]:
        """The ranks this plan repaired among ``mismatches`` (those it was made from): for each tensor moved,
        the ranks that held another value than its source.

        >>> tie = Mismatch("w", "param", [1], [0], detail="tie vote: rank 0 vs rank 1, no majority")
        >>> ResyncPlan({1: ["w"]}).receivers([tie])
        [0]
        """
        source = {(kind, n): r for kind, plan in (("param", self.sources), ("grad", self.grads))
                  for r, names in plan.items() for n in names}  # fmt: skip
        out: set[int] = set()
        for m in mismatches:
            s = source.get(("grad" if m.kind == "grad" else "param", m.name))
            if s is not None:
                out.update(m.ranks if s in m.reference_ranks else [*m.reference_ranks, *(r for r in m.ranks if r != s)])
        return sorted(out)


def _finite_source(m: Mismatch, source: int) -> int | None:
    """``source``, unless its copy holds NaN/inf: then the first finite copy (reference side first);
    ``None`` when every copy holds NaN/inf."""
    bad = m.nonfinite or {}
    if source not in bad:
        return source
    return next((r for r in (*m.reference_ranks, *m.ranks) if r not in bad), None)


def plan_resync(mismatches: Sequence[Mismatch], src: ResyncSource, *, tie_chosen_by: str | None = None) -> ResyncPlan:
    """The source of each mismatch's tensor (structure differences are left out). ``tie_chosen_by``: what
    chose ``src`` for a tie, in the note (:func:`~weightsync_audit.engine.attribution.resync_source`'s words).

    Raises :class:`~weightsync_audit.ResyncError` naming the tensors of which no copy is finite.
    """
    chosen: dict[int, list[str]] = {}
    grads: dict[int, list[str]] = {}
    outvoted: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    ties: dict[int, list[str]] = {}
    finite: dict[tuple[int, int], list[str]] = {}
    hopeless: list[str] = []
    for m in mismatches:
        if m.kind == "structure" or not m.reference_ranks or is_derived(m.name):
            continue
        if src == "majority":
            source = m.reference_ranks[0]
        elif src in m.reference_ranks or (m.tie and src in m.ranks):
            source = src  # holds the reference value, or one side of a tie: the user's choice decides
        elif src in m.ranks:
            source = m.reference_ranks[0]
            if _finite_source(m, source) == source:
                outvoted.setdefault((source, tuple(m.reference_ranks)), []).append(m.name)
        else:
            source = m.reference_ranks[0]
        safe = _finite_source(m, source)
        if safe is None:
            hopeless.append(f"{m.kind} {m.name}")
            continue
        if safe != source:
            finite.setdefault((source, safe), []).append(m.name)
            source = safe
        elif m.tie:
            ties.setdefault(source, []).append(m.name)
        (grads if m.kind == "grad" else chosen).setdefault(source, []).append(m.name)
    if hopeless:
        raise ResyncError(
            f"cannot resync {brief_names(hopeless)}: every rank's copy holds NaN or inf, so no rank is a "
            "safe source; restore a checkpoint",
            None,
            untouched=hopeless,
        )
    plan = ResyncPlan({r: chosen[r] for r in sorted(chosen)}, grads={r: grads[r] for r in sorted(grads)})
    for (unsafe, source), names in finite.items():
        plan.notes.append(
            f"rank {unsafe} holds NaN/inf in {brief_names(names)} where rank {source} holds finite values: "
            f"resynced from rank {source}, never from a non-finite copy"
        )
    for (source, refs), names in outvoted.items():
        plan.notes.append(
            f"resync_src={src} holds a minority value of {brief_names(names)} ({fmt_ranks(refs)} hold the majority "
            f"value): resynced from rank {source}, a majority holder, instead"
        )
    default = "resync_src" if src != "majority" else "the side holding the lowest rank"
    for source, names in ties.items():
        plan.notes.append(
            f"tie vote on {brief_names(names)}: no majority, resynced from rank {source} ({tie_chosen_by or default})"
        )
    return plan


RESYNC_KINDS = frozenset({"param", "buffer", "optimizer"})
"""What a resync copies by name (gradients are asked for apart, with ``grads``)."""


@dataclass(frozen=True, slots=True)
class ResyncState:
    """The channel, the model and optimizers, and (right after an audit) the manifest that audit built."""

    comm: Comm
    module: nn.Module | None
    optimizers: list[torch.optim.Optimizer]
    audited: PreparedManifest | None = None
    """The manifest of the audit this resync follows, under the replica rules; ``None``: one is built."""
    diverged: frozenset[str] = frozenset()
    """The names (of :data:`RESYNC_KINDS`) that audit found differing: the names its manifest answers for."""

    def entries(self, wanted: set[str] | None) -> list[Entry]:
        """This rank's params, buffers and optimizer state (or those ``wanted``) under the replica rules."""
        if self.audited is not None and wanted is not None and wanted <= self.diverged:
            manifest = self.audited.manifest
        else:
            manifest = replica_manifest(self.module, self.optimizers)
        return [e for e in manifest.entries if e.kind in RESYNC_KINDS and (wanted is None or e.name in wanted)]

    def rebuilt(self) -> ResyncState:
        """The state for what follows a resync that changed the optimizers' structure: manifests built anew."""
        return ResyncState(self.comm, self.module, self.optimizers)


def prepare_resync(module: Any, optimizer: Any, comm: Comm) -> ResyncState:
    """The state a resync prepares for itself over ``comm`` (its manifest built when first read).

    ``module`` may be a pipelining ``PipelineStage`` (its stage module is resynced); ``optimizer`` anything
    the audit takes (one, a wrapped one, a sequence)."""
    optimizers = as_optimizers(optimizer)
    return ResyncState(comm, stage_module(module), optimizers)


@dataclass(frozen=True, slots=True)
class Holding:
    """One rank's view of one tensor (or Python value) a resync may copy: one row of the plan's round."""

    kind: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    """This rank's local shape (a DTensor's shard)."""
    digest: int
    layout: str = ""
    """The replica layout (``""``: plain, every rank a peer)."""
    key: int = ALL
    """The peer key: the ranks with one key hold one replica."""
    members: tuple[int, ...] = ()
    """A declared group's ranks as positions (``(-1,)``: found by the audit)."""
    literal: str | None = None
    """A Python value's ``repr`` (``None``: a tensor)."""
    state: bool = False
    """Per-parameter optimizer state (the source's is installed where the structure differs)."""

    @property
    def uid(self) -> str:
        return f"{self.kind}:{self.name}"

    @classmethod
    def of(cls, e: Entry, digest: int, global_ranks: Sequence[int]) -> Holding:
        """``e``'s row on this rank (``global_ranks``: the channel's, to name declared members by position)."""
        where = {int(g): i for i, g in enumerate(global_ranks)}
        info, value = e.shard, e.container[e.key] if e.container is not None else None
        named = info.members if info is not None else ()
        members = (-1,) if named == FOUND else tuple(where[int(g)] for g in named if int(g) in where)
        literal = repr(value) if e.container is not None and not isinstance(value, torch.Tensor) else None
        layout, key = ("", ALL) if info is None else (info.layout, int(info.key))
        state = e.kind == "optimizer" and not (isinstance(e.container, dict) and "params" in e.container)
        shape = tuple(e.tensor.shape)
        return cls(e.kind, e.name, e.dtype, shape, int(digest), layout, key, members, literal, state)

    def row(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def read(cls, row: Sequence[Any]) -> Holding:
        k, n, dtype, shape, digest, layout, key, members, literal, state = row
        return cls(k, n, dtype, tuple(shape), digest, layout, key, tuple(members), literal, state)


def _groups(rows: list[Holding | None], found: dict[int, set[int]]) -> tuple[list[tuple[list[int], list[int]]], str]:
    """The replica groups of one tensor as ``(holders, group)`` from every rank's row (``None``: not held),
    or why its structure differs (``""``: it does not)."""
    world = len(rows)
    held = [r for r in range(world) if rows[r] is not None]
    keys = [None if row is None else row.key for row in rows]
    members = [row.members if row is not None else () for row in rows]
    if all(is_holders(rows[r].layout) for r in held) and (len(held) < world or any(members)):  # type: ignore[union-attr]
        return replica_groups(keys, members, found), ""
    if len(held) < world:
        return [], f"missing on {fmt_ranks([r for r in range(world) if r not in held])}"
    return [(s, s) for s in peer_sets([int(k) for k in keys]) if len(s) > 1], ""  # type: ignore[arg-type]


def _literal(text: str) -> str | None:
    """Why ``text`` cannot be installed as a Python value, else ``None``."""
    try:
        ast.literal_eval(text)  # literals only: never executes code
    except (ValueError, SyntaxError):
        return f"its value {text[:80]!r} is not a Python literal"
    return None


def _install(rows: Sequence[Holding]) -> dict[str, Any]:
    """The source's per-parameter optimizer state, as every other rank creates it: a tensor's dtype and
    shape (its bytes follow with the copies), a Python value's literal."""
    return {h.name: ({"v": h.literal} if h.literal is not None else {"t": [h.dtype, list(h.shape)]})
            for h in rows if h.state and not is_holders(h.layout)}  # fmt: skip


def plan_copies(
    manifests: Sequence[Sequence[Holding]], src: int, chosen: Mapping[str, Sequence[int]] | None = None
) -> dict[str, Any]:
    """The copies that make every replica group agree, from every rank's rows, ranks as positions:
    ``{"copies": [[uid, source, receivers, dtype, shape]], "values": [[uid, source, receivers, literal]],
    "refused": [why], "install": {name: spec} or None}`` in one order (the tensors' first-seen order).

    The source of a group is the first of ``chosen[name]`` (a gradient's: ``chosen["grad:" + name]``), else
    ``src``, among its holders, else its majority holder. ``install``: the structure of optimizer state differs, the source's to install (no copies yet)."""
    world, chosen = len(manifests), chosen or {}
    by_rank = [{h.uid: h for h in rows} for rows in manifests]
    found = carriers([((h.key, h.members) for h in rows) for rows in manifests])
    out: dict[str, Any] = {"copies": [], "values": [], "refused": [], "install": None}
    install = False
    for uid in dict.fromkeys(uid for d in by_rank for uid in d):
        rows = [d.get(uid) for d in by_rank]
        first = next(h for h in rows if h is not None)
        groups, why = _groups(rows, found)
        for _, group in groups:
            sigs = {None if rows[r] is None else (rows[r].dtype, rows[r].shape, rows[r].key) for r in group}  # type: ignore[union-attr]
            why = why or (f"differs in structure within its replica group {fmt_ranks(group)}" if len(sigs) > 1 else "")
        if why:
            if first.kind == "optimizer" and not is_holders(first.layout):
                install = True  # the source's structure is installed, then planned again
            else:
                out["refused"].append(f"{uid} {why}")
            continue
        for holders, _ in groups:
            digests = [rows[r].digest if r in holders else None for r in range(world)]  # type: ignore[union-attr]
            source = next(
                (s for s in (*chosen.get(uid if first.kind == "grad" else first.name, ()), src) if s in holders), None
            )
            source = majority_within(digests, holders)[0][0] if source is None else source
            receivers = [r for r in holders if r != source and digests[r] != digests[source]]
            row = rows[source]
            if not receivers or row is None:
                continue
            if is_derived(row.name):
                if is_holders(row.layout):
                    out["refused"].append(
                        f"{row.name} differs on {fmt_ranks(receivers)} from rank {source}: what it checks "
                        "(optimizer state of a shard) has no replica to copy from; restore it from a checkpoint"
                    )
            elif row.literal is None:
                out["copies"].append([uid, source, receivers, row.dtype, list(row.shape)])
            elif (bad := _literal(row.literal)) is not None:
                out["refused"].append(f"{uid}: {bad}")
            else:
                out["values"].append([uid, source, receivers, row.literal])
    if install and not out["refused"]:
        out.update(copies=[], values=[], install=_install(manifests[src]))
    return out
