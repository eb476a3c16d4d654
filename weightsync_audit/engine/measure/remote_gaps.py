"""Phase (d) of an audit: how far each diverged tensor is from its reference value, measured over the
data plane, best effort.

For each chosen tensor the reference rank (the lowest rank holding the reference value) sends its copy
in chunks straight to the ranks that differ (:mod:`~weightsync_audit.channel.dataplane`); each of those
folds chunk after chunk into a :class:`~weightsync_audit.engine.measure.gaps.GapMeter`, so no rank holds more
than a chunk of a copy, whatever the tensor's size. Every rank then shares, over the star, its numbers
and a status code per tensor, and every rank fills the mismatches from that gathered table: a transfer
that failed or ran out of time leaves ``detail = "gap not measured: <why>"`` on every rank alike, and
the audit returns its verdict as usual.

What may be moved is bounded up front (``max_diff_tensors``, ``max_diff_bytes``, ``gap_budget_s``), and
the same plan is made on every rank, so the deadlines agree too.

Small tensors skip the data plane: the reference rank and the odd ranks add their copies of the diverged
tensors of up to :data:`INLINE_GAP_BYTES` in all to the layouts' round, and the coordinator measures
those gaps there (the same :class:`~weightsync_audit.engine.measure.gaps.GapMeter`, the same table every
rank would have built). The last round (the layouts' when nothing is left to move, else the gaps') also
carries what the caller's ``finish`` makes, on the coordinator, of the mismatches as they will be settled
(the hints): a divergence of small tensors costs the star one round here, not three.

One tensor over the data plane: sent from its logical chunks, received chunk by chunk into a sink.

Both sides cut the tensor with :func:`~weightsync_audit.engine.hashing.reader.chunk_views`, which depends
on the shape and dtype only, so every chunk is received into a buffer of exactly the size sent (gloo
aborts the process on a size mismatch), whatever the layouts and devices on either side. A rank never
holds more than one chunk of the copy.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Callable, Protocol

import numpy as np
import torch
import xxhash

from weightsync_audit.channel.dataplane import CHUNK_BYTES, DataPlane, Schedule, TransferFailure
from weightsync_audit.channel.star import Comm
from weightsync_audit.channel.wire import compact_rows, expand_rows
from weightsync_audit.engine.hashing.reader import byte_view, chunk_views, host_chunk
from weightsync_audit.engine.inventory.manifest import Entry
from weightsync_audit.engine.measure.gaps import GapMeter
from weightsync_audit.reporting.record import Mismatch

__all__ = [
    "Finish",
    "INLINE_GAP_BYTES",
    "Sink",
    "measure_gaps",
    "measure_held_gaps",
    "receive_tensor",
    "send_tensor",
    "tensor_bytes",
]

Sink = Callable[[torch.Tensor, torch.Tensor], None]
"""Called with (this rank's view of the chunk, the received chunk as a CPU tensor of the same shape)."""


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _step(t: torch.Tensor) -> int:
    return max(1, CHUNK_BYTES // t.element_size())


def send_tensor(
    plane: DataPlane, t: torch.Tensor, alive: list[int], sched: Schedule, before: int
) -> dict[int, TransferFailure]:
    """Send ``t`` to each rank in ``alive``; a receiver that fails is removed from ``alive`` (in place)
    and the others still get it all. ``before`` is how many bytes of the plan precede this transfer
    (for the deadlines). Returns the failures by receiver.
    """
    failures: dict[int, TransferFailure] = {}
    fan_out = len(alive)
    done = 0
    for view in chunk_views(t.detach(), _step(t)):
        if not alive:
            break
        chunk = byte_view(host_chunk(view))
        done += chunk.numel() * fan_out
        for dst, f in plane.send(chunk, alive, sched.deadline(before + done)).items():
            failures[dst] = f
            alive.remove(dst)
    return failures


def receive_tensor(
    plane: DataPlane, t: torch.Tensor, src: int, sched: Schedule, before: int, fan_out: int, sink: Sink
) -> tuple[TransferFailure | None, int, BaseException | None]:
    """Receive ``src``'s copy of ``t`` chunk by chunk, handing each to ``sink``.

    ``fan_out`` is how many ranks the sender serves (its bytes count against the deadlines). Returns
    (the transfer failure, chunks handed to the sink, the sink's first error). After a sink error the
    remaining chunks are still taken, so that the sender is never left waiting.
    """
    esize = t.element_size()
    step = _step(t)
    buf = torch.empty(min(step, t.numel()) * esize, dtype=torch.uint8)
    done = sunk = 0
    error: BaseException | None = None
    for view in chunk_views(t.detach(), step):
        n = view.numel() * esize
        done += n * fan_out
        try:
            plane.recv(buf[:n], src, sched.deadline(before + done))
        except TransferFailure as f:
            return f, sunk, error
        if error is not None:
            continue
        try:
            sink(view, buf[:n].view(t.dtype).reshape(view.shape))
            sunk += 1
        except Exception as exc:  # noqa: BLE001 - returned to the caller, which reports it
            error = exc
    return None, sunk, error


INLINE_GAP_BYTES = 768
"""Bytes of diverged tensors a rank adds to the layouts' round, so that their gaps are measured there."""

Finish = Callable[[list[Mismatch], np.ndarray], bytes]
"""Run on the coordinator in the last round: from copies of the mismatches with their gaps filled and the
gathered ``extra`` columns, the bytes every rank gets back (see :func:`measure_gaps`)."""


class GapSettings(Protocol):
    """What the gap phase reads of the audit's settings (an :class:`~weightsync_audit.engine.config.AuditConfig`)."""

    max_diff_tensors: int
    max_diff_bytes: int
    gap_budget_s: float
    tolerance: float | None


_OK, _TIMED_OUT, _BROKEN, _NO_PLANE, _LOCAL, _PENDING = range(6)
_NOTHING = torch.empty(0)
_FIELDS = 5  # per tensor and rank: max |diff| (float64 bits), max |reference| (float64 bits), code, peer, count


def _layout_row(entries: list[Entry]) -> np.ndarray:
    """Each tensor's bytes and dtype-and-shape digest on this rank.

    Planned from these rows gathered, every rank makes the same plan even where local tensors differ (a
    DTensor's shard on a rank outside the peer set), and a copy only goes to a rank whose tensor has the
    reference's layout, so that every chunk is received into a buffer of the size sent.
    """
    row = np.zeros(2 * len(entries), dtype=np.int64)
    for j, e in enumerate(entries):
        if e.dtype not in ("none", "object"):
            t = e.tensor
            row[2 * j] = tensor_bytes(t)
            row[2 * j + 1] = xxhash.xxh3_64_intdigest(f"{t.dtype}{tuple(t.shape)}".encode()) >> 1
    return row


def _inline_blob(rank: int, mismatches: list[Mismatch], entries: list[Entry]) -> bytes:
    """This rank's copies of the small diverged tensors it holds a side of (reference or odd), for the
    coordinator to measure: a JSON head (index, dtype, shape of each), then the bytes."""
    head, body, used = [], [], 0
    for i, (m, e) in enumerate(zip(mismatches, entries)):
        if e.dtype in ("none", "object") or (rank != m.reference_ranks[0] and rank not in m.ranks):
            continue
        t = e.tensor.detach()
        n = tensor_bytes(t)
        if n == 0 or used + n > INLINE_GAP_BYTES:
            continue
        body.append(byte_view(host_chunk(t)).numpy().tobytes())
        head.append([i, str(t.dtype).removeprefix("torch."), list(t.shape)])
        used += n
    if not head:
        return b""
    text = json.dumps(head).encode()
    return len(text).to_bytes(8, "little") + text + b"".join(body)


def _copies(blob: bytes) -> dict[int, torch.Tensor]:
    if len(blob) < 8:
        return {}
    n = int.from_bytes(blob[:8], "little")
    out, pos = {}, 8 + n
    for i, dtype, shape in json.loads(blob[8 : 8 + n]):
        dt = getattr(torch, dtype)
        k = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
        out[i] = torch.frombuffer(bytearray(blob[pos : pos + k]), dtype=torch.uint8).view(dt).reshape(shape)
        pos += k
    return out


def _gap_rows(world: int, count: int) -> np.ndarray:
    rows = np.zeros((world, _FIELDS * count), dtype=np.int64)
    rows[:, 2::_FIELDS] = _OK
    rows[:, 3::_FIELDS] = -1
    return rows


def _measure_inline(
    mismatches: list[Mismatch], chosen: list[int], layouts: np.ndarray, blobs: list[bytes]
) -> np.ndarray:
    """On the coordinator: the gap table of the chosen tensors whose copies came inline; ``_PENDING``
    marks those left to the data plane. The rows each rank would have filled itself."""
    copies = [_copies(b) for b in blobs]
    rows = _gap_rows(len(blobs), len(chosen))
    for k, i in enumerate(chosen):
        m, at = mismatches[i], _FIELDS * k
        ref, receivers = m.reference_ranks[0], _receivers(layouts, m, i)
        pieces = [copies[r].get(i) for r in (ref, *receivers)]
        if any(p is None or p.shape != pieces[0].shape or p.dtype != pieces[0].dtype for p in pieces):
            rows[:, at + 2] = _PENDING
            continue
        for r in m.ranks:
            if r not in receivers:
                rows[r, at + 2] = _LOCAL  # another layout than the reference's
        for r in receivers:
            meter = GapMeter()
            try:
                meter.update(copies[r][i], copies[ref][i])
            except Exception:  # noqa: BLE001 - said as "could not compare", as a receiver would
                rows[r, at + 2] = _LOCAL
                continue
            rows[r, at : at + 2] = (_f2i(meter.max_abs_diff), _f2i(meter.max_reference))
            rows[r, at + 4] = meter.diff_count
    return rows


def _receivers(layouts: np.ndarray, m: Mismatch, i: int) -> list[int]:
    ref = m.reference_ranks[0]
    return [r for r in m.ranks if (layouts[r, 2 * i : 2 * i + 2] == layouts[ref, 2 * i : 2 * i + 2]).all()]


def _choose(cfg: GapSettings, mismatches: list[Mismatch], layouts: np.ndarray, grace_s: float) -> list[int]:
    """Which tensors to measure: the same list on every rank (from the gathered layouts and settings)."""
    chosen: list[int] = []
    planned = 0
    for i, m in enumerate(mismatches):
        if len(chosen) >= cfg.max_diff_tensors and cfg.tolerance is None:  # a tolerance needs every gap
            break
        nbytes = int(layouts[m.reference_ranks[0], 2 * i])
        if nbytes == 0:
            continue
        if nbytes > cfg.max_diff_bytes:
            _note(m, "too large for max_abs_diff")
            continue
        moved = nbytes * len(_receivers(layouts, m, i))
        if Schedule.bound_s(planned + moved, grace_s) > cfg.gap_budget_s:
            _note(
                m,
                f"gap not measured: moving its reference copy ({moved / 2**20:.1f} MiB) would not fit "
                f"in gap_budget_s={cfg.gap_budget_s:g}",
            )
            continue
        planned += moved
        chosen.append(i)
    return chosen


def _measure_into(meter: GapMeter) -> Sink:
    return lambda mine, theirs: meter.update(host_chunk(mine), theirs)


def _f2i(x: float) -> int:
    return int(np.array([x], dtype=np.float64).view(np.int64)[0])


def _i2f(x: int) -> float:
    return float(np.array([x], dtype=np.int64).view(np.float64)[0])


def _why(code: int, rank: int, peer: int) -> str:
    if code == _TIMED_OUT:
        return f"the transfer between rank {rank} and rank {peer} ran past its deadline"
    if code == _BROKEN:
        return f"the connection between rank {rank} and rank {peer} failed"
    if code == _NO_PLANE:
        return f"the data plane could not be opened on rank {rank}"
    return f"rank {rank} could not compare the two copies"


def measure_gaps(
    comm: Comm,
    cfg: GapSettings,
    mismatches: list[Mismatch],
    entries: list[Entry],
    extra: np.ndarray | None = None,
    finish: Finish | None = None,
) -> tuple[np.ndarray, bytes | None]:
    """Fill ``max_abs_diff``, ``diff_count`` (and ``rel_diff`` where the record has it) of value mismatches.

    Collective over ``comm``: every rank calls it with the same mismatches (ranks as positions in the
    group) and its own entries for them. Never raises for a failed transfer; a failure of the star
    itself (a rank gone) raises as every exchange does. ``extra``: int64 values of this rank that ride
    the layouts' round (one round fewer for the caller); returned gathered, ``[world, len(extra)]``, with
    what ``finish`` made on the coordinator in the last round (``None`` without ``finish``).
    """
    extra = np.zeros(0, dtype=np.int64) if extra is None else extra
    width = 2 * len(entries)
    blob = _inline_blob(comm.rank, mismatches, entries) if comm.distributed else b""

    def first(table: np.ndarray, blobs: list[bytes]) -> bytes:  # on the coordinator
        ms = copy.deepcopy(mismatches)
        chosen = _choose(cfg, ms, table[:, :width], comm.grace_s)
        inline = _measure_inline(ms, chosen, table[:, :width], blobs)
        gaps = compact_rows([r.tobytes() for r in inline])
        done = not (inline[:, 2::_FIELDS] == _PENDING).any()
        return len(gaps).to_bytes(8, "little") + gaps + (settled(ms, chosen, inline, table[:, width:]) if done else b"")

    def settled(ms: list[Mismatch], chosen: list[int], gaps: np.ndarray, extra: np.ndarray) -> bytes:
        """On the coordinator: ``finish`` of the copies ``ms`` once their gaps are filled as every rank fills them."""
        _fill(comm.global_ranks, ms, chosen, gaps)
        return finish(ms, extra) if finish is not None else b""

    what = "the layouts of the diverged tensors"
    table, tail = comm.exchange_then(np.concatenate([_layout_row(entries), extra.astype(np.int64)]), what,
                                     blob=blob, then=first)  # fmt: skip
    layouts, gathered = table[:, :width], table[:, width:]
    if not comm.distributed:
        return gathered, None
    chosen = _choose(cfg, mismatches, layouts, comm.grace_s)
    k = int.from_bytes(tail[:8], "little")
    gaps = expand_rows(tail[8 : 8 + k], comm.world_size)
    assert isinstance(gaps, np.ndarray)  # rows the coordinator built: always of one length
    pending = [c for c in range(len(chosen)) if (gaps[:, _FIELDS * c + 2] == _PENDING).any()]
    if not pending:
        _fill(comm.global_ranks, mismatches, chosen, gaps)
        return gathered, tail[8 + k :] or None
    row = gaps[comm.rank].copy()
    total = _transfer(comm, mismatches, entries, layouts, [(c, chosen[c]) for c in pending], row)

    def last(table: np.ndarray, blobs: list[bytes]) -> bytes:  # on the coordinator
        ms = copy.deepcopy(mismatches)
        _choose(cfg, ms, layouts, comm.grace_s)
        return settled(ms, chosen, table, gathered)

    table, fin = comm.exchange_then(row, "the max |diff| values", then=last, extra_s=total)
    if any((~np.isin(table[:, _FIELDS * c + 2], (_OK, _LOCAL))).any() for c in pending):
        DataPlane(comm).discard()  # every rank sees the same table, so every rank retires the group alike
    _fill(comm.global_ranks, mismatches, chosen, table)
    return gathered, fin or None


def _transfer(
    comm: Comm,
    mismatches: list[Mismatch],
    entries: list[Entry],
    layouts: np.ndarray,
    pending: list[tuple[int, int]],
    row: np.ndarray,
) -> float:
    """Move the reference copies of the ``pending`` (column, tensor) pairs over the data plane, filling
    this rank's ``row``; the seconds the slowest transfer may still take on another rank."""
    sched = Schedule(comm.grace_s)
    sizes = {i: int(layouts[mismatches[i].reference_ranks[0], 2 * i]) for _, i in pending}
    fan_out = {i: _receivers(layouts, mismatches[i], i) for _, i in pending}
    total = sum(sizes[i] * len(fan_out[i]) for _, i in pending)
    for c, _ in pending:
        row[_FIELDS * c : _FIELDS * (c + 1)] = (0, 0, _OK, -1, 0)
    plane = DataPlane(comm)
    opened = True
    try:
        plane.open(Schedule.bound_s(0, comm.grace_s) + (comm.timeout_s or 0.0))
    except TransferFailure:
        opened = False
    before = 0
    for c, i in pending:
        e, m = entries[i], mismatches[i]
        ref, t, receivers = m.reference_ranks[0], e.tensor.detach(), fan_out[i]
        at = _FIELDS * c
        if comm.rank in m.ranks and comm.rank not in receivers:
            row[at + 2] = _LOCAL  # this rank's tensor has another layout than the reference's
        elif not opened and (comm.rank == ref or comm.rank in receivers):
            row[at + 2] = _NO_PLANE
        elif comm.rank == ref:
            # A failed peer fails this transfer only; after a timeout the data plane refuses at once.
            for peer, f in send_tensor(plane, t, list(receivers), sched, before).items():
                row[at + 2 : at + 4] = (_TIMED_OUT if f.timed_out else _BROKEN, peer)
                break
        elif comm.rank in receivers:
            meter = GapMeter()
            f, _, local = receive_tensor(plane, t, ref, sched, before, len(receivers), _measure_into(meter))
            if f is not None:
                row[at + 2 : at + 4] = (_TIMED_OUT if f.timed_out else _BROKEN, ref)
            elif local is not None:
                row[at + 2] = _LOCAL
            else:
                row[at : at + 2] = (_f2i(meter.max_abs_diff), _f2i(meter.max_reference))
                row[at + 4] = meter.diff_count
        before += sizes[i] * len(receivers)
    return sched.left_s(total)


def _fill(g: tuple[int, ...], mismatches: list[Mismatch], chosen: list[int], table: np.ndarray) -> None:
    """The mismatches' gaps from the gathered gap table (``g``: the group's global ranks)."""
    for k, i in enumerate(chosen):
        m = mismatches[i]
        codes = table[:, _FIELDS * k + 2]
        bad = [int(r) for r in np.nonzero(codes != _OK)[0]]
        if bad:
            r = next((r for r in bad if codes[r] == _TIMED_OUT), bad[0])  # the cause, not its echo
            peer = int(table[r, _FIELDS * k + 3])
            _note(m, "gap not measured: " + _why(int(codes[r]), g[r], g[peer] if peer >= 0 else -1))
            continue
        diffs = [_i2f(int(table[r, _FIELDS * k])) for r in m.ranks]
        worst = max(diffs, key=lambda v: (math.isnan(v), v))
        reference = max(_i2f(int(table[r, _FIELDS * k + 1])) for r in m.ranks)
        m.max_abs_diff = None if math.isnan(worst) else float(worst)
        m.diff_count = max(int(table[r, _FIELDS * k + 4]) for r in m.ranks)  # the odd rank furthest off
        if hasattr(m, "rel_diff"):
            rel = 0.0 if worst == 0 else (worst / reference if reference > 0 and math.isfinite(worst) else None)
            m.rel_diff = rel
        # Which side holds a NaN or inf is said by engine/measure/finite.py, from every rank's own count.


def _note(m: Mismatch, text: str) -> None:
    """Add to a mismatch's detail, keeping what is there (a tie vote, a structure note)."""
    m.detail = f"{text}; {m.detail}" if m.detail else text


def measure_held_gaps(
    comm: Comm, cfg: GapSettings, mismatches: list[Mismatch], uids: list[str], entries: list[Entry]
) -> None:
    """:func:`measure_gaps` for tensors that only some ranks hold by design (a pipeline stage's, compared
    among its data-parallel group): ``uids[i]`` names ``mismatches[i]``'s tensor; a rank that does not hold
    it takes part with an empty stand-in (no bytes: neither the reference nor a receiver). Collective:
    every rank calls it with the same mismatches, which every rank derived from the same gathered manifests.
    """
    mine = {e.uid: e for e in entries}
    held = [mine.get(u) or Entry(u.partition(":")[2], u.partition(":")[0], _NOTHING, "none", ()) for u in uids]
    measure_gaps(comm, cfg, mismatches, held)
