"""Making replicas equal again: parameters, buffers, optimizer state and gradients copied from their source.

A resync decides everything in one round of the audit channel: every rank sends the rows of what it holds
(:class:`~weightsync_audit.engine.repair.plan.Holding`), the coordinator plans every copy once
(:func:`~weightsync_audit.engine.repair.plan.plan_copies`: plain tensors, tensors held by some ranks by
design and DTensor shards alike), and every rank makes the same copies in the same order. A tensor whose
structure differs within its replica group is refused on every rank alike before anything moves; optimizer
state that exists on the source only is created on the others first (a second round), so that afterwards
every replica is bit-identical to its source.

Tensors travel over the audit's data plane (:func:`move_copies`): in chunks from the source straight to each
receiver, written in place, every wait bounded by a deadline that grows with the bytes
(``grace_s + bytes / FLOOR_BYTES_PER_S``, bytes counted once per receiver; the closing exchange
``timeout_s + grace_s`` beyond whatever of that is left). After the transfers every rank tells the others
whether its part went through, so they all return, or all raise :class:`~weightsync_audit.ResyncError`
together, naming the rank that failed (the source, when it died or stopped), this rank's tensors that may
hold a mix of old and new values (``partial``) and the ones not written at all (``untouched``).
"""

from __future__ import annotations

import ast
import json
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from weightsync_audit.channel.dataplane import DataPlane, Schedule, TransferFailure
from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.auditor import Auditor
from weightsync_audit.engine.hashing.digest import digest_entries
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.engine.inventory.peers import is_holders, unreplicated_label
from weightsync_audit.engine.inventory.replicas import replica_manifest
from weightsync_audit.engine.measure.remote_gaps import receive_tensor, send_tensor, tensor_bytes
from weightsync_audit.engine.repair.plan import (
    Holding,
    ResyncPlan,
    ResyncSource,
    ResyncState,
    check_resync_src,
    plan_copies,
    plan_resync,
    prepare_resync,
)
from weightsync_audit.errors import ResyncError, WeightSyncAuditError
from weightsync_audit.text import brief_names

__all__ = ["Copy", "move_copies", "resync", "resync_from", "resync_planned", "state_device"]


def resync(
    module: nn.Module | None,
    optimizer: Any = None,
    *,
    src: ResyncSource = 0,
    group: Any = None,
    names: Sequence[str] | None = None,
    timeout_s: float | None = None,
    grads: bool | Sequence[str] = False,
) -> None:
    """Broadcast params, buffers and optimizer state (or only ``names``) from rank ``src``, in place.

    ``grads``: also the gradients, of every parameter (``True``) or of the parameters named; ``.grad``
    is overwritten in place (a gradient missing on some rank is a structure difference: refused).

    Collective over ``group``. ``src`` is a rank of ``group``, or ``"majority"``: the ranks audit first
    and each diverged tensor comes from a rank holding its reference value (see
    :mod:`weightsync_audit.engine.repair.plan`). Without a process group it does nothing.
    A sharded tensor (DTensor) is copied shard by shard within its peer set, from ``src`` when it holds
    that shard, else from the rank holding the shard's majority value (see docs/sharded.md).

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> resync(model)   # no process group: nothing to do
    """
    src = check_resync_src(src, "src")
    if src == "majority":
        _resync_by_majority(module, optimizer, group=group, names=names, timeout_s=timeout_s)
        return
    comm = Comm(group, timeout_s)
    if _moves(comm, src):
        resync_from(prepare_resync(module, optimizer, comm), src, names=names, grads=grads)


def resync_planned(state: ResyncState, plan: ResyncPlan) -> None:
    """Carry out ``plan`` (the same on every rank) from ``state``, every source's tensors and gradients in
    one round. The plan names global ranks, as the record does."""
    if not plan.ranks():
        return
    position = {g: i for i, g in enumerate(state.comm.global_ranks)}
    chosen: dict[str, list[int]] = {}
    for source in plan.ranks():
        for name in plan.sources.get(source, []):
            chosen.setdefault(name, []).append(position[source])
        for name in plan.grads.get(source, []):
            chosen.setdefault(f"grad:{name}", []).append(position[source])
    tensors = [n for names in plan.sources.values() for n in names]
    grads = [n for names in plan.grads.values() for n in names]
    resync_from(state, position[plan.ranks()[0]], names=tensors, grads=grads, chosen=chosen)


def resync_from(
    state: ResyncState,
    src: int,
    *,
    names: Sequence[str] | None = None,
    grads: bool | Sequence[str] = False,
    chosen: Mapping[str, Sequence[int]] | None = None,
) -> ResyncState:
    """:func:`resync` from the rank ``src`` of ``state``'s channel, reading ``state`` (collective).
    ``chosen``: another source (positions) for some tensors (see :func:`~weightsync_audit.engine.repair.plan.plan_copies`).

    Returns the state for a next resync: ``state`` itself, or one that builds its manifests anew when this
    one created or deleted optimizer state (the structures differed: the same on every rank)."""
    comm = state.comm
    if not _moves(comm, src):
        return state
    wanted = set(names) if names is not None else None
    entries = _entries(state, grads, wanted)
    plan = _decide(comm, entries, src, chosen, "")
    if plan["install"] is not None:  # optimizer state differs in structure: the source's, then plan again
        failure = ""
        if comm.rank != src:
            held = {
                id(e.container) for e in entries if e.kind == "optimizer" and e.shard and is_holders(e.shard.layout)
            }
            try:
                _install_state(plan["install"], state.optimizers, state.module, held)
            except ValueError as exc:  # refused before anything was changed; every rank raises it alike
                failure = str(exc)
        state = state.rebuilt()
        entries = _entries(state, grads, wanted)
        plan = _decide(comm, entries, src, chosen, failure)
        if plan["install"] is not None:
            raise ValueError(
                "cannot resync: the optimizers differ in structure between ranks (param groups or parameters "
                "not in the same order); rebuild the optimizer the same way on every rank"
            )
    _move(comm, src, entries, plan)
    return state


def _moves(comm: Comm, src: int) -> bool:
    """Whether a resync from ``src`` over ``comm`` moves anything (no process group: nothing); a ``src``
    outside the group is refused."""
    if not 0 <= src < comm.world_size:
        raise ValueError(f"src={src}: must be a rank of the group (0..{comm.world_size - 1})")
    return comm.distributed


def _entries(state: ResyncState, grads: bool | Sequence[str], wanted: set[str] | None) -> list[Entry]:
    """This rank's entries to plan: those ``wanted`` with a replica somewhere, and the gradients asked for."""
    entries = state.entries(wanted)
    if grads and state.module is not None:  # False, or no gradient named: the same on every rank
        pick = wanted if grads is True else set(grads)  # type: ignore[arg-type]
        got = replica_manifest(state.module, state.optimizers, include=("grads",)).entries
        entries += [e for e in got if pick is None or e.name in pick]
    # One owner: nothing to copy it from, nothing to copy it to; None: nothing to copy.
    return [e for e in entries if e.dtype != "none" and unreplicated_label(e.shard) is None]


def _decide(
    comm: Comm, entries: list[Entry], src: int, chosen: Mapping[str, Sequence[int]] | None, failure: str
) -> dict[str, Any]:
    """The plan of the copies, decided by the coordinator from every rank's rows (one round); raises
    ``ValueError`` on every rank alike when a rank's ``failure`` says or the plan refuses something."""
    digests = digest_entries(entries).tolist() if entries else []
    rows = [Holding.of(e, d, comm.global_ranks).row() for e, d in zip(entries, digests)]
    g = comm.global_ranks

    def rule(parts: list[bytes]) -> bytes:
        got = [json.loads(p) for p in parts]
        failed = [f"rank {g[r]}: {x['failed']}" for r, x in enumerate(got) if x["failed"]]
        if failed:
            return json.dumps({"failed": failed}).encode()
        return json.dumps(plan_copies([[Holding.read(h) for h in x["rows"]] for x in got], src, chosen)).encode()

    plan = json.loads(comm.decide(json.dumps({"rows": rows, "failed": failure}).encode(), rule, "the resync plan"))
    if plan.get("failed"):
        raise ValueError("cannot resync (nothing was changed): " + "; ".join(plan["failed"][:3]))
    if plan["refused"]:
        raise ValueError(
            "cannot resync (nothing was changed): some tensors differ in structure within their replica group, "
            "not only in values: " + "; ".join(plan["refused"][:10])
        )
    return plan


def _move(comm: Comm, src: int, entries: list[Entry], plan: dict[str, Any]) -> None:
    """The planned copies (the same on every rank): tensors in place, then Python values replaced in their dict."""
    mine = {f"{e.kind}:{e.name}": e for e in entries}  # Holding.uid
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


def _install_state(
    src_state: dict[str, Any],
    optimizers: list[torch.optim.Optimizer],
    module: nn.Module | None,
    engine_held: set[int] = frozenset(),  # type: ignore[assignment]
) -> None:
    from weightsync_audit.engine.inventory.manifest import unwrap_module

    user = unwrap_module(module) if module is not None else None
    # Look-ups by identity, built once: this path may run over thousands of parameters.
    optimizer_of = {id(p): opt for opt in optimizers for g in opt.param_groups for p in g["params"]}
    names_in_opt = {n: p for n, p in user.named_parameters() if id(p) in optimizer_of} if user is not None else {}
    name_of = {id(p): n for n, p in names_in_opt.items()}
    missing = [full for full in src_state if full.rpartition(".")[0] not in names_in_opt]
    if missing:  # checked before anything is deleted: a refused resync changes nothing
        pname = missing[0].rpartition(".")[0]
        raise ValueError(f"optimizer state {missing[0]!r}: no parameter {pname!r} in this rank's optimizer")
    keep: dict[str, set[str]] = {}
    for full in src_state:
        pname, _, key = full.rpartition(".")
        keep.setdefault(pname, set()).add(key)
    # Drop state the source does not have, then install the source's.
    for opt in optimizers:
        for p in list(opt.state):
            pname = name_of.get(id(p))
            if pname is None or id(opt.state[p]) in engine_held:
                continue  # not the user's parameter, or its state is held in pieces (never deleted here)
            for key in list(opt.state[p]):
                if str(key) not in keep.get(pname, ()):
                    del opt.state[p][key]
            if not opt.state[p]:
                del opt.state[p]
    for full, spec in src_state.items():
        pname, _, key = full.rpartition(".")
        p = names_in_opt[pname]
        opt = optimizer_of[id(p)]
        if "t" in spec:
            dtype_name, shape = spec["t"][:2]
            dtype = getattr(torch, dtype_name)
            group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
            # Created empty where torch's optimizers keep it; the source's bytes arrive with the planned copies.
            opt.state[p][key] = torch.empty(shape, dtype=dtype, device=state_device(p, group, key, len(shape)))
        else:
            opt.state[p][key] = ast.literal_eval(spec["v"])


def state_device(param: torch.Tensor, group: dict[str, Any], key: str, dim: int) -> torch.device:
    """Where torch's optimizers keep state ``key`` of ``param`` (``dim``: the state's number of dims).

    The rule of ``torch.optim.Optimizer._process_value_according_to_param_policy``: a 0-dim ``step``
    stays on the host unless the group is ``fused`` or ``capturable``, which keep it on the parameter's
    device; everything else goes to the parameter's device.

    >>> import torch
    >>> p = torch.nn.Parameter(torch.zeros(2, device="meta"))
    >>> state_device(p, {"capturable": False}, "step", 0), state_device(p, {"fused": True}, "step", 0)
    (device(type='cpu'), device(type='meta'))
    """
    if key == "step" and dim == 0 and not (group.get("fused") or group.get("capturable")):
        return torch.device("cpu")
    return param.device


def _resync_by_majority(
    module: nn.Module | None, optimizer: Any, *, group: Any, names: Sequence[str] | None, timeout_s: float | None
) -> None:
    """Audit, then resync each diverged tensor from a rank holding its reference value, reading what that
    audit prepared (its channel, its manifest)."""
    auditor = Auditor(module, optimizer, group=group, timeout_s=timeout_s)
    result = auditor.audit()
    structural = [m.name for m in result.mismatches if m.kind == "structure"]
    if structural:
        raise ValueError(f"cannot resync by majority: the structure differs ({', '.join(structural[:5])})")
    wanted = set(names) if names is not None else None
    chosen = [m for m in result.mismatches if wanted is None or m.name in wanted]
    resync_planned(auditor.resync_state(result), plan_resync(chosen, "majority"))


_OK, _TIMED_OUT, _BROKEN, _LOCAL = range(4)


def _write(view: torch.Tensor, chunk: torch.Tensor) -> None:
    with torch.no_grad():
        view.copy_(chunk)


def _code(f: TransferFailure) -> int:
    return _TIMED_OUT if f.timed_out else _BROKEN


Copy = tuple[str, torch.Tensor, int, list[int]]
"""``(name, this rank's tensor, source rank, receiving ranks)``: ranks are positions in the group."""


def move_copies(comm: Comm, src: int, copies: list[Copy]) -> None:
    """Make each copy (the same list on every rank): its source sends, its receivers write in place.

    ``src`` is the rank a failure is blamed on in a tie (the resync's source). Collective over ``comm``:
    every rank takes part in the closing exchange, also one that moves nothing.
    """
    plane = DataPlane(comm)
    sched = Schedule(comm.grace_s)
    total = sum(tensor_bytes(t) * len(dsts) for _, t, _, dsts in copies)
    mine: tuple[int, int] = (_OK, -1)  # this rank's first failure: (code, peer as a group position)
    why = ""
    partial: list[str] = []
    untouched: list[str] = []
    try:
        plane.open(Schedule.bound_s(0, comm.grace_s) + (comm.timeout_s or 0.0))
    except TransferFailure as f:
        mine, why = (_LOCAL, -1), str(f)
    dead: set[int] = set()  # receivers that failed: sent nothing more
    before = 0
    for name, t, source, dsts in copies:
        if comm.rank == source:
            alive = [r for r in dsts if r not in dead]
            if mine[0] != _LOCAL:
                for peer, f in send_tensor(plane, t, alive, sched, before).items():
                    dead.add(peer)
                    if mine[0] == _OK:
                        mine, why = (_code(f), peer), str(f)
        elif comm.rank not in dsts:
            pass
        elif mine[0] != _OK:
            untouched.append(name)
        else:
            f, written, error = receive_tensor(plane, t, source, sched, before, len(dsts), _write)
            if f is not None or error is not None:
                (partial if written else untouched).append(name)
                mine, why = (
                    ((_code(f), source), str(f)) if f is not None else ((_LOCAL, -1), f"writing {name}: {error}")
                )
        before += tensor_bytes(t) * len(dsts)

    g = comm.global_ranks
    try:
        table = comm.exchange_within(np.array(mine, dtype=np.int64), "the resync result", sched.left_s(total))
    except WeightSyncAuditError as exc:
        missing = list(getattr(exc, "missing_ranks", []))
        failed = missing[0] if missing else (g[mine[1]] if mine[1] >= 0 else None)
        raise _error(comm, src, failed, f"{exc}", partial, untouched) from exc
    if (table[:, 0] == _OK).all():
        return
    plane.discard()  # every rank sees the same table: every rank retires the data group alike
    bad = [r for r in range(comm.world_size) if table[r, 0] != _OK]
    # The rank most often named by the others is the one that failed; a tie goes to the source.
    named = [int(table[r, 1]) for r in bad if table[r, 1] >= 0]
    blamed = max(set(named), key=lambda p: (named.count(p), p == src)) if named else bad[0]
    reasons = "; ".join(
        f"rank {g[r]}: "
        + ("timed out" if table[r, 0] == _TIMED_OUT else "failed")
        + (f" with rank {g[int(table[r, 1])]}" if table[r, 1] >= 0 else "")
        for r in bad
    )
    here = f" (here: {why})" if why else ""
    raise _error(comm, src, g[blamed], reasons + here, partial, untouched)


def _error(comm: Comm, src: int, failed: int | None, why: str, partial: list[str], untouched: list[str]) -> ResyncError:
    g = comm.global_ranks
    who = f"rank {failed} failed (died, stopped or lost its connection)" if failed is not None else "a rank failed"
    left = []
    if partial:
        left.append(f"may be left partial: {brief_names(partial)}")
    if untouched:
        left.append(f"not resynced: {brief_names(untouched)}")
    state = "; ".join(left) if left else "no tensor of this rank was left partial"
    return ResyncError(
        f"weightsync resync from rank {g[src]} did not complete: {who}: {why}. On rank {g[comm.rank]}, {state}; "
        "replicas may differ: resync again or restore a checkpoint before training on",
        failed,
        partial,
        untouched,
    )
