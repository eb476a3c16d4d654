"""How ``resync`` moves tensors: from the source straight to every other rank over the data plane,
chunk by chunk, written in place, every wait bounded; a failure is agreed on and named.

After the transfers every rank tells the others, over the star, whether its part went through, so
they all return, or all raise :class:`~weightsync_audit.ResyncError`, together. The error names the
rank that failed (the source, when it died or stopped) and lists this rank's tensors that may hold a
mix of old and new values (``partial``) and the ones not written at all (``untouched``).

Time bound: the transfers take at most ``grace_s + bytes / FLOOR_BYTES_PER_S`` (bytes counted once per
receiver), and the closing exchange ``timeout_s + grace_s`` beyond whatever of that is left.
"""

from __future__ import annotations

import numpy as np
import torch

from weightsync_audit.channel.dataplane import DataPlane, Schedule, TransferFailure
from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.measure.remote_gaps import receive_tensor, send_tensor, tensor_bytes
from weightsync_audit.errors import ResyncError, WeightSyncAuditError
from weightsync_audit.text import brief_names

__all__ = ["Copy", "move_copies", "move_tensors"]

_OK, _TIMED_OUT, _BROKEN, _LOCAL = range(4)


def _write(view: torch.Tensor, chunk: torch.Tensor) -> None:
    with torch.no_grad():
        view.copy_(chunk)


def _code(f: TransferFailure) -> int:
    return _TIMED_OUT if f.timed_out else _BROKEN


def move_tensors(comm: Comm, src: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Overwrite ``tensors`` (name, tensor; the same list on every rank) with rank ``src``'s values.

    Collective over ``comm``. Raises :class:`~weightsync_audit.ResyncError` on every rank when a rank
    failed; the error of the star itself (a rank gone) is turned into one too.
    """
    others = [r for r in range(comm.world_size) if r != src]
    move_copies(comm, src, [(name, t, src, others) for name, t in tensors])


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
