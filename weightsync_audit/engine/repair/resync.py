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
from weightsync_audit.engine.hashing.hostbytes import host_bytes
from weightsync_audit.engine.inventory.manifest import Entry, as_optimizers, build_manifest
from weightsync_audit.engine.inventory.replicas import assign_replicas
from weightsync_audit.engine.repair.resync_plan import ResyncSource, check_resync_src, plan_resync
from weightsync_audit.engine.repair.resync_transfer import move_tensors
from weightsync_audit.engine.repair.shard_resync import resync_shards

__all__ = ["resync"]


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
) -> None:
    """Broadcast params, buffers and optimizer state (or only ``names``) from rank ``src``, in place.

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
    if not 0 <= src < comm.world_size:
        raise ValueError(f"src={src}: must be a rank of the group (0..{comm.world_size - 1})")
    if not comm.distributed:
        return
    optimizers = as_optimizers(optimizer)
    wanted = set(names) if names is not None else None
    manifest = build_manifest(module, optimizers, include=("params", "buffers", "optimizer"))
    # Each engine's replica rules (FSDP1 shards, ZeRO partitions, expert groups): a tensor is copied only
    # within its holders, never broadcast over ranks that hold other shards.
    assign_replicas(manifest, module, optimizers, refuse_stages="resync")
    entries = [e for e in manifest.entries if wanted is None or e.name in wanted]

    # Agree on what is held before moving anything: the same structure everywhere is the fast path.
    structure = structure_digest(entries)
    table = comm.exchange(np.array([structure, len(entries)], dtype=np.int64), "the resync")
    if not (table == table[0]).all():
        entries = _reconcile(comm, src, entries, optimizers, module)
        if wanted is not None:
            entries = [e for e in entries if e.name in wanted]
        again = comm.exchange(np.array([structure_digest(entries), len(entries)], dtype=np.int64), "the resync")
        if not (again == again[0]).all():
            raise ValueError(
                "cannot resync: the optimizers differ in structure between ranks (param groups or parameters "
                "not in the same order); rebuild the optimizer the same way on every rank"
            )

    # Tensors (parameters, buffers, optimizer state tensors) are overwritten in place; Python values
    # (learning rates, integer steps) are replaced in their dict.
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
    if tensor_entries:
        move_tensors(comm, src, [(e.name, e.tensor) for e in tensor_entries])
    if value_entries:
        blob = json.dumps([host_bytes(e.tensor).hex() for e in value_entries]).encode() if comm.rank == src else None
        values = json.loads(comm.share_bytes(src, blob, "the resync values"))
        for e, hexed in zip(value_entries, values):
            e.container[e.key] = _decode_value(e, bytes.fromhex(hexed))


def _reconcile(
    comm: Comm, src: int, entries: list[Entry], optimizers: list[torch.optim.Optimizer], module: nn.Module | None
) -> list[Entry]:
    """Structures differ: keep what matches the source, create missing optimizer state, refuse the rest."""
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

    # Optimizer state: give every rank exactly the source's entries (per-parameter state as tensors).
    if comm.rank == src:
        payload = {}
        for e in entries:
            if e.kind == "optimizer" and e.container is not None and not _is_param_group(e):
                value = e.container[e.key]
                if isinstance(value, torch.Tensor):
                    t = value.detach().contiguous().cpu()
                    payload[e.name] = {"t": [str(t.dtype).removeprefix("torch."), list(t.shape), host_bytes(t).hex()]}
                else:
                    payload[e.name] = {"v": repr(value)}
        blob = json.dumps(payload).encode()
    else:
        blob = None
    src_state = json.loads(comm.share_bytes(src, blob, "the resync optimizer state"))
    if comm.rank != src:
        _install_state(src_state, optimizers, module)
        entries = assign_replicas(
            build_manifest(module, optimizers, include=("params", "buffers", "optimizer")), module, optimizers
        ).entries
    # Installed state is already the source's; broadcast the rest by the (now equal) structure.
    installed = set(src_state)
    return [e for e in entries if e.name not in installed]


def _is_param_group(e: Entry) -> bool:
    return isinstance(e.container, dict) and "params" in e.container


def _install_state(
    src_state: dict[str, Any], optimizers: list[torch.optim.Optimizer], module: nn.Module | None
) -> None:
    from weightsync_audit.engine.inventory.manifest import unwrap_module

    user = unwrap_module(module) if module is not None else None
    # Look-ups by identity, built once: this path may run over thousands of parameters.
    optimizer_of = {id(p): opt for opt in optimizers for g in opt.param_groups for p in g["params"]}
    names_in_opt = {n: p for n, p in user.named_parameters() if id(p) in optimizer_of} if user is not None else {}
    name_of = {id(p): n for n, p in names_in_opt.items()}
    keep: dict[str, set[str]] = {}
    for full in src_state:
        pname, _, key = full.rpartition(".")
        keep.setdefault(pname, set()).add(key)
    # Drop state the source does not have, then install the source's.
    for opt in optimizers:
        for p in list(opt.state):
            pname = name_of.get(id(p))
            if pname is None:
                continue
            for key in list(opt.state[p]):
                if str(key) not in keep.get(pname, ()):
                    del opt.state[p][key]
            if not opt.state[p]:
                del opt.state[p]
    for full, spec in src_state.items():
        pname, _, key = full.rpartition(".")
        p = names_in_opt.get(pname)
        if p is None:
            raise ValueError(f"cannot resync optimizer state {full!r}: no parameter {pname!r} in this rank's optimizer")
        opt = optimizer_of[id(p)]
        if "t" in spec:
            dtype_name, shape, hexed = spec["t"]
            dtype = getattr(torch, dtype_name)
            raw = bytes.fromhex(hexed)
            t = (
                torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).clone()
                if raw
                else torch.empty(shape, dtype=dtype)
            )
            device = p.device if key != "step" or t.dim() else torch.device("cpu")
            opt.state[p][key] = t.to(device)
        else:
            opt.state[p][key] = ast.literal_eval(spec["v"])


def _resync_by_majority(
    module: nn.Module | None, optimizer: Any, *, group: Any, names: Sequence[str] | None, timeout_s: float | None
) -> None:
    """Audit, then resync each diverged tensor from a rank holding its reference value."""
    auditor = Auditor(module, optimizer, group=group, timeout_s=timeout_s)
    result = auditor.audit()
    structural = [m.name for m in result.mismatches if m.kind == "structure"]
    if structural:
        raise ValueError(f"cannot resync by majority: the structure differs ({', '.join(structural[:5])})")
    wanted = set(names) if names is not None else None
    chosen = [m for m in result.mismatches if wanted is None or m.name in wanted]
    position = {g: i for i, g in enumerate(auditor.comm.global_ranks)}
    for source, tensors in plan_resync(chosen, "majority").sources.items():
        resync(module, optimizer, src=position[source], group=group, names=tensors, timeout_s=timeout_s)
