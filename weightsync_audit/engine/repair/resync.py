"""Making replicas equal again: broadcast parameters, buffers and optimizer state from one rank.

Tensors travel over the audit's data plane (:mod:`~weightsync_audit.engine.repair.resync_transfer`): in
chunks from the source straight to every other rank, every wait bounded by a deadline that grows with
the bytes, so a source that dies or stops makes the others raise :class:`~weightsync_audit.ResyncError`
naming it, with the tensors that may be left partial, instead of waiting out the process group's
timeout. Python values (learning rates, betas) are read back from the source's exact encoding. Before anything moves,
the ranks compare what they hold; a tensor whose shape differs is refused on every rank alike, and
optimizer state that exists on the source only is created on the others, so that afterwards every
replica is bit-identical to the source.
"""

from __future__ import annotations

import ast
import json
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.auditor import Auditor
from weightsync_audit.engine.hashing.digest import structure_digest
from weightsync_audit.engine.hashing.reader import host_bytes
from weightsync_audit.engine.inventory.manifest import Entry, build_manifest
from weightsync_audit.engine.inventory.replicas import assign_replicas, declares_groups, replica_manifest
from weightsync_audit.engine.inventory.replicas.keys import HOLDERS, is_holders, unreplicated_label_of
from weightsync_audit.engine.repair.held_resync import resync_held
from weightsync_audit.engine.repair.resync_plan import (
    ResyncPlan,
    ResyncSource,
    check_resync_src,
    is_derived,
    plan_resync,
)
from weightsync_audit.engine.repair.resync_transfer import move_copies, move_tensors
from weightsync_audit.engine.repair.shard_resync import plan_held_copies, resync_shards
from weightsync_audit.engine.repair.state import ResyncState, prepare_resync

__all__ = ["resync", "resync_from", "resync_planned", "state_device"]


def _decode_value(entry: Entry, blob: bytes) -> Any:
    """The Python value the source holds, rebuilt from its exact tensor encoding."""
    if entry.dtype == "none":
        return None
    if entry.dtype == "object":
        text = blob.decode("utf-8")
        try:
            return ast.literal_eval(text)  # literals only: never executes code
        except (ValueError, SyntaxError) as exc:
            raise TypeError(f"cannot resync {entry.name!r}: its value {text[:80]!r} is not a Python literal") from exc
    t = (
        torch.frombuffer(bytearray(blob), dtype=entry.tensor.dtype)
        if blob
        else torch.empty(0, dtype=entry.tensor.dtype)
    )
    old = entry.container[entry.key]
    values = t.tolist()
    if isinstance(old, (tuple, list)):
        return type(old)(values)
    return values[0] if isinstance(values, list) else values


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
    :mod:`weightsync_audit.engine.repair.resync_plan`). Without a process group it does nothing.
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
    """Carry out ``plan`` (the same on every rank) from ``state``: each source rank's tensors and gradients,
    the sources in ascending order. The plan names global ranks, as the record does."""
    position = {g: i for i, g in enumerate(state.comm.global_ranks)}
    for source in plan.ranks():
        tensors, grads = plan.sources.get(source, []), plan.grads.get(source, [])
        state = resync_from(state, position[source], names=tensors, grads=grads)


def resync_from(
    state: ResyncState, src: int, *, names: Sequence[str] | None = None, grads: bool | Sequence[str] = False
) -> ResyncState:
    """:func:`resync` from the rank ``src`` of ``state``'s channel, reading ``state`` (collective).

    Returns the state for a next resync: ``state`` itself, or one that builds its manifests anew when this
    one created or deleted optimizer state (the structures differed: the same on every rank)."""
    comm = state.comm
    if not _moves(comm, src):
        return state
    wanted = set(names) if names is not None else None
    if declares_groups(state.module):  # pipeline stages, expert groups: copied within each group
        resync_held(comm, state.entries(wanted) + _held_grads(state.module, state.optimizers, grads, wanted), src)
        return state
    entries, held = _split(picked := state.entries(wanted))
    grad_entries = _grad_entries(comm, state.module, grads, wanted)

    # Agree on what is held before moving anything: the same structure everywhere is the fast path.
    structure = structure_digest(entries, devices=False)
    table = comm.exchange(np.array([structure, len(entries), len(held)], dtype=np.int64), "the resync")
    # Tensors some ranks hold by design: planned (or refused, on every rank alike) before anything moves.
    held_copies = plan_held_copies(comm, held, src, is_derived) if table[:, 2].any() else []
    reconciled = not (table[:, :2] == table[0, :2]).all()
    if reconciled:
        entries = _reconcile(comm, src, entries, state.optimizers, state.module, picked)
        entries = [e for e in entries if wanted is None or e.name in wanted]
        again = comm.exchange(
            np.array([structure_digest(entries, devices=False), len(entries)], dtype=np.int64), "the resync"
        )
        if not (again == again[0]).all():
            raise ValueError(
                "cannot resync: the optimizers differ in structure between ranks (param groups or parameters "
                "not in the same order); rebuild the optimizer the same way on every rank"
            )
    _move(comm, src, entries, grad_entries, held_copies)
    return state.rebuilt() if reconciled else state


def _moves(comm: Comm, src: int) -> bool:
    """Whether a resync from ``src`` over ``comm`` moves anything (no process group: nothing); a ``src``
    outside the group is refused."""
    if not 0 <= src < comm.world_size:
        raise ValueError(f"src={src}: must be a rank of the group (0..{comm.world_size - 1})")
    return comm.distributed


def _move(comm: Comm, src: int, entries: list[Entry], grad_entries: list[Entry], held_copies: list[Any]) -> None:
    """The copies, once the structures agree: tensors in place, Python values replaced in their dict."""
    # Tensors are overwritten in place; Python values (learning rates, integer steps) replaced in their dict.
    value_entries = [e for e in entries if e.container is not None and not isinstance(e.container[e.key], torch.Tensor)]
    tensor_entries = [
        e
        for e in entries
        if e.dtype != "none" and (e.container is None or isinstance(e.container[e.key], torch.Tensor))
    ]
    # The structures agree here, and a DTensor's layout is part of them: every rank splits alike.
    shard_entries = [e for e in tensor_entries if e.shard is not None]
    if shard_entries:
        tensor_entries = [e for e in tensor_entries if e.shard is None]
        resync_shards(comm, shard_entries, src)
    tensor_entries += [e for e in grad_entries if e.dtype != "none"]
    if tensor_entries:
        move_tensors(comm, src, [(e.name, e.tensor) for e in tensor_entries])
    if held_copies:  # the same list on every rank (drawn from the gathered table)
        move_copies(comm, src, held_copies)
    if value_entries:
        blob = json.dumps([host_bytes(e.tensor).hex() for e in value_entries]).encode() if comm.rank == src else None
        values = json.loads(comm.share_bytes(src, blob, "the resync values"))
        for e, hexed in zip(value_entries, values):
            e.container[e.key] = _decode_value(e, bytes.fromhex(hexed))


def _split(entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """``(compared everywhere, held by some ranks by design)``; what has no replica, and the checks drawn
    from other tensors (never copied themselves), are left out of the first."""
    plain, held = [], []
    for e in entries:
        layout = e.shard.layout if e.shard is not None else ""
        if unreplicated_label_of(layout) is not None:
            continue  # one owner: nothing to copy it from, nothing to copy it to
        if layout.startswith(HOLDERS):
            held.append(e)
        elif not is_derived(e.name):
            plain.append(e)
    return plain, held


def _grad_entries(
    comm: Comm, module: nn.Module | None, grads: bool | Sequence[str], wanted: set[str] | None
) -> list[Entry]:
    """The gradients to broadcast (collective when any: their structure must agree on every rank)."""
    if not grads or module is None:  # False, or no gradient named (the same on every rank: the same plan)
        return []
    pick = wanted if grads is True else set(grads)  # type: ignore[arg-type]
    entries = [e for e in build_manifest(module, include=("grads",)).entries if pick is None or e.name in pick]
    table = comm.exchange(np.array([structure_digest(entries), len(entries)], dtype=np.int64), "the resync")
    if not (table == table[0]).all():
        raise ValueError(
            "cannot resync gradients: they differ in structure between ranks (a gradient is None on some "
            f"ranks, or has another shape or dtype): {', '.join(sorted(e.name for e in entries)[:5])}"
        )
    return entries


def _held_grads(
    module: nn.Module | None,
    optimizers: list[torch.optim.Optimizer],
    grads: bool | Sequence[str],
    wanted: set[str] | None,
) -> list[Entry]:
    """The gradients to copy along with a declared layout's tensors, named as the audit names them."""
    if not grads or module is None:
        return []
    pick = wanted if grads is True else set(grads)  # type: ignore[arg-type]
    entries = assign_replicas(build_manifest(module, include=("grads",)), module, optimizers).entries
    return [e for e in entries if pick is None or e.name in pick]


def _reconcile(
    comm: Comm,
    src: int,
    entries: list[Entry],
    optimizers: list[torch.optim.Optimizer],
    module: nn.Module | None,
    every: list[Entry],
) -> list[Entry]:
    """Structures differ: keep what matches the source, create missing optimizer state, refuse the rest.

    ``every``: this rank's entries before :func:`_split`; the state of a parameter any of them holds in
    pieces (an engine's) is never deleted nor created here."""
    rows = [[e.kind, e.name, e.dtype, list(e.shape)] for e in entries]
    manifests = [json.loads(b) for b in comm.exchange_bytes(json.dumps(rows).encode(), "the resync manifests")]
    src_rows = {(k, n): (d, tuple(s)) for k, n, d, s in manifests[src]}
    problems = []
    for r, rows_r in enumerate(manifests):
        held = {(k, n): (d, tuple(s)) for k, n, d, s in rows_r}
        for key, sig in held.items():
            if key in src_rows and src_rows[key] != sig and key[0] != "optimizer":
                problems.append(
                    f"{key[0]} {key[1]!r} is {sig[0]} {list(sig[1])} on rank {comm.global_ranks[r]} but {src_rows[key][0]} {list(src_rows[key][1])} on the source"
                )
            if key not in src_rows and key[0] != "optimizer":
                problems.append(f"{key[0]} {key[1]!r} exists on rank {comm.global_ranks[r]} but not on the source")
        for key in src_rows:
            if key not in held and key[0] != "optimizer":
                problems.append(f"{key[0]} {key[1]!r} is missing on rank {comm.global_ranks[r]}")
    if problems:
        raise ValueError(
            "cannot resync: the models differ in structure, not only in values: " + "; ".join(problems[:10])
        )

    # Optimizer state: give every rank exactly the source's entries. Only their description (dtype and
    # shape of a tensor, the literal of a Python value) goes through the star; the bytes of the tensors
    # follow over the data plane with the other tensors (move_tensors: chunked, every wait bounded).
    if comm.rank == src:
        payload = {}
        for e in entries:
            if e.kind == "optimizer" and e.container is not None and not _is_param_group(e):
                value = e.container[e.key]
                if isinstance(value, torch.Tensor):
                    payload[e.name] = {"t": [str(value.dtype).removeprefix("torch."), list(value.shape)]}
                else:
                    payload[e.name] = {"v": repr(value)}
        blob = json.dumps(payload).encode()
    else:
        blob = None
    src_state = json.loads(comm.share_bytes(src, blob, "the resync optimizer state"))
    failure = ""
    if comm.rank != src:
        engine_held = {
            id(e.container) for e in every if e.kind == "optimizer" and e.shard and is_holders(e.shard.layout)
        }
        try:
            _install_state(src_state, optimizers, module, engine_held)
        except ValueError as exc:  # refused before anything was changed; every rank raises it alike
            failure = str(exc)
    said = comm.exchange_bytes(failure.encode(), "the resync optimizer state check")
    refused = [f"rank {comm.global_ranks[r]}: {b.decode()}" for r, b in enumerate(said) if b]
    if refused:
        raise ValueError("cannot resync (nothing was changed): " + "; ".join(refused[:3]))
    if comm.rank != src:
        entries = _split(replica_manifest(module, optimizers).entries)[0]
    # Installed Python values are already the source's; tensors (created empty) and the rest are
    # broadcast by the (now equal) structure.
    installed = {name for name, spec in src_state.items() if "v" in spec}
    return [e for e in entries if e.name not in installed]


def _is_param_group(e: Entry) -> bool:
    return isinstance(e.container, dict) and "params" in e.container


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
            # Created empty where torch's optimizers keep it; the source's bytes arrive by move_tensors.
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
