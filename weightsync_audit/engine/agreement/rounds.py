"""The audit's decisions taken once, by the coordinator, and sent to every rank as one compact answer.

Each function here gathers every rank's data on the channel's coordinator, runs the pure function of
:mod:`~weightsync_audit.engine.agreement.consensus` on it there, and returns its result on every rank. So every
rank ends with the same verdict, while no rank receives the other ranks' data: a healthy audit answers
each rank a fixed-size verdict, and a divergence answers only the columns that differ.

>>> import numpy as np
>>> from weightsync_audit.channel.star import Comm
>>> agree(Comm(), np.zeros(8, dtype=np.int64)).status
'in_sync'

When the summaries say the audit cannot go on: a rank failed to prepare it, or the ranks are out of step.

Both are said alike on every rank, after one more round in which each rank tells what it knows (its
error, its position), so that every rank raises the same error naming the same ranks.

The audit's steps for sharded tensors (DTensors): peer keys out, peer sets and shard names back.

Only a manifest holding DTensors takes these steps. Its structure (global shapes and layouts) is the
same on every rank once phase (a) found equal structure digests, so every rank takes the same steps;
each decision below comes from gathered data, never from what one rank holds alone.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from typing import Any, Sequence

import numpy as np
import xxhash

from weightsync_audit.channel.star import Comm
from weightsync_audit.channel.wire import LEGACY_INLINE_BYTES
from weightsync_audit.engine.agreement.consensus import (
    PROTOCOL_FAILED,
    SUMMARY_FIELDS,
    Agreement,
    StructureDiff,
    ValueDiff,
    compare_digest_table,
    compare_manifests,
    judge_summaries,
    union_counts,
)
from weightsync_audit.engine.inventory.manifest import KINDS, Entry
from weightsync_audit.engine.inventory.peers import ALL, holders_label, unpaired_columns, unreplicated_label
from weightsync_audit.errors import AuditOutOfStepError, AuditPreparationError
from weightsync_audit.text import COMPARED_NOTES, NOTHING_COMPARED, NOTHING_TO_AUDIT

__all__ = [
    "Agreement",
    "SKETCH_BUCKETS",
    "agree",
    "bucket_sketch",
    "compare_columns",
    "compare_sharded",
    "compare_structures",
    "compared_counts",
    "localize_values",
    "peer_keys",
    "raise_failed",
    "shared_failures",
    "raise_out_of_step",
    "shard_names",
    "sharded_notes",
]


def peer_keys(entries: Sequence[Entry]) -> np.ndarray:
    """This rank's peer key per entry: ``ALL`` for a plain tensor."""
    return np.fromiter((ALL if e.shard is None else e.shard.key for e in entries), dtype=np.int64, count=len(entries))


def compare_sharded(comm: Comm, entries: Sequence[Entry], digests: np.ndarray) -> tuple[list[ValueDiff], np.ndarray]:
    """Phase (b) for a sharded manifest: gather digests and peer keys together; majorities per peer set.

    Returns the value differences and the gathered ``[world, n]`` peer-key table.
    """
    n = len(entries)
    both = comm.exchange(np.concatenate([np.asarray(digests, dtype=np.int64), peer_keys(entries)]), "the digests")
    table, peers = both[:, :n], both[:, n:]
    return compare_digest_table([e.uid for e in entries], table, peers), peers


def shard_names(comm: Comm, diffs: Sequence[ValueDiff], by_uid: dict[str, Entry]) -> list[dict[str, int] | None]:
    """The mesh coordinates of each differing shard (``None`` for a plain tensor), the same on every rank.

    A rank knows only its own coordinates, so the ranks exchange theirs for the diverged shards; every
    rank then names each shard after the coordinates of the first rank of its peer set.
    """
    sharded = [i for i, d in enumerate(diffs) if d.peer_set is not None]
    out: list[dict[str, int] | None] = [None] * len(diffs)
    if not sharded:
        return out
    mine = []
    for i in sharded:
        shard = by_uid[diffs[i].uid].shard
        mine.append(shard.coords if shard is not None else None)
    blobs = [json.loads(b) for b in comm.exchange_bytes(json.dumps(mine).encode(), "the shard coordinates")]
    for k, i in enumerate(sharded):
        coords = blobs[diffs[i].peer_set[0]][k]
        # A DTensor replicated on every mesh dimension has no coordinates to name: it is no shard.
        out[i] = {str(name): int(c) for name, c in coords.items()} if coords else None
    return out


def compared_counts(entries: Sequence[Entry], peers: np.ndarray | None) -> tuple[dict[str, int], dict[str, int]]:
    """Per kind, the tensors compared on at least one peer set; and the tensors with no peer, by what they
    are (``DTensor shard``, ``ZeRO optimizer partition``...: an engine's single-owner entries are never
    compared, whatever the world size, so a ZeRO-3 placeholder is never counted)."""
    counts = dict.fromkeys(KINDS, 0)
    for e in entries:
        counts[e.kind] += 1
    alone = set(unpaired_columns(peers)) | {j for j, e in enumerate(entries) if unreplicated_label(e.shard)}
    unpaired: dict[str, int] = {}
    for j in sorted(alone):
        counts[entries[j].kind] -= 1
        shard = entries[j].shard
        label = unreplicated_label(shard) or (shard and holders_label(shard.layout)) or "DTensor shard"
        unpaired[label] = unpaired.get(label, 0) + 1
    return counts, unpaired


#: How a note names each kind an audit may be asked for.
_KIND_WORDS = {"params": "parameter", "buffers": "buffer", "optimizer": "optimizer state", "grads": "gradient"}


def sharded_notes(
    counts: dict[str, int],
    unpaired: dict[str, int] | int,
    params_held: int,
    params_wanted: bool,
    include: Sequence[str] = (),
) -> list[str]:
    """One summary note for the tensors nobody else holds, and one when no parameter was compared; first,
    when no tensor at all was compared, why: every one has a single holder (:data:`NOTHING_COMPARED`), or
    there was none of the kinds in ``include`` to audit (:data:`NOTHING_TO_AUDIT`).

    >>> sharded_notes(dict.fromkeys(("param", "buffer", "optimizer", "grad"), 0), 0, 0, True, ("params",))
    ['nothing was compared: no tensor to audit (no parameter found: a module without any, or exclude= left none)']
    """
    notes = []
    alone = sum(unpaired.values()) if isinstance(unpaired, dict) else unpaired
    if alone and not any(counts.values()):
        notes.append(f"{NOTHING_COMPARED} (each of the {alone} audited tensors is held by one rank only)")
    elif not alone and not any(counts.values()):
        kinds = [_KIND_WORDS[k] for k in include if k in _KIND_WORDS] or ["tensor"]
        what = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " or " + kinds[-1]
        notes.append(f"{NOTHING_TO_AUDIT} (no {what} found: a module without any, or exclude= left none)")
    if isinstance(unpaired, dict) and set(unpaired) - {"DTensor shard"}:
        total = sum(unpaired.values())
        kinds = ", ".join(f"{n} {label}{'' if n == 1 else 's'}" for label, n in unpaired.items())
        notes.append(
            f"{total} tensor{' has' if total == 1 else 's have'} {COMPARED_NOTES[1]} ({kinds}): each is held by one "
            "rank only, so it is not counted in checked; see docs/sharded.md"
        )
    elif unpaired:
        unpaired = sum(unpaired.values()) if isinstance(unpaired, dict) else unpaired
        notes.append(
            f"{unpaired} sharded tensor{' has' if unpaired == 1 else 's have'} {COMPARED_NOTES[1]}: each is held by "
            "one rank only (a pure FSDP shard, a Partial placement); see docs/sharded.md"
        )
    if params_wanted and params_held and not counts["param"]:
        notes.append(f"{COMPARED_NOTES[0]}: no rank holds a replica of any parameter shard")
    return notes


def shared_failures(comm: Comm, failure: BaseException | None) -> dict[int, str]:
    """Every rank's failure message (this rank's ``failure``), shared: global rank -> message of those that failed."""
    mine = "" if failure is None else f"{type(failure).__name__}: {failure}"
    parts = comm.exchange_bytes(mine.encode(), "the failure report")
    return {comm.global_ranks[r]: b.decode("utf-8", "replace") for r, b in enumerate(parts) if b}


def raise_failed(comm: Comm, failure: BaseException | None, failed: dict[int, str] | None = None) -> None:
    """This rank's own error raised, or one naming the ranks that failed (``failed``: :func:`shared_failures`,
    shared here when not given)."""
    failed = shared_failures(comm, failure) if failed is None else failed
    if failure is not None:
        raise failure
    text = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
    raise AuditPreparationError(
        f"weightsync audit could not run because other ranks failed to prepare it: {text}", failed
    )


def raise_out_of_step(comm: Comm, fields: Sequence[str], position: dict[str, Any]) -> None:
    """Every rank's ``position`` (step, epoch, hook, config, slice) shared, and the error naming each."""
    if "protocol" in fields:  # a rank may run the previous release: frames it can read, never abort on
        comm.inline_limit = LEGACY_INLINE_BYTES
    positions = [json.loads(b) for b in comm.exchange_bytes(json.dumps(position).encode(), "the out-of-step report")]
    lines = {}
    for r, p in enumerate(positions):
        where = [f"step {p['step']}", f"epoch {p['epoch']}", f"hook {p['hook']}"]
        if "config" in fields or "protocol" in fields:
            where.append(p["config"])
        if "slice" in fields:
            where.append(f"sample slice {p['slice']} (ranks audited a different number of times)")
        lines[comm.global_ranks[r]] = ", ".join(where)
    text = "; ".join(f"rank {r}: {w}" for r, w in lines.items())
    raise AuditOutOfStepError(
        f"ranks reached the weight audit out of step ({', '.join(fields)} differ), so their weights "
        f"cannot be compared: {text}",
        lines,
    )


SKETCH_BUCKETS = 32
"""Contiguous buckets of the digest column whose 8-bit sketches ride the summary (4 words, 32 bytes)."""


@functools.lru_cache(maxsize=64)
def _cuts(nbytes: int) -> list[slice]:
    """The non-empty buckets of a digest column of ``nbytes`` bytes, as slices of its bytes."""
    size = 8 * (-(-nbytes // (8 * SKETCH_BUCKETS)) or 1)
    return [slice(b * size, (b + 1) * size) for b in range(-(-nbytes // size))]


_EMPTY_BUCKET = xxhash.xxh3_64_intdigest(b"") >> 1


def bucket_sketch(digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The summary's sketch of ``digests`` (``SKETCH_BUCKETS`` 8-bit digests packed in 4 int64 words) and
    the buckets' full 64-bit digests (kept by the rank, for :func:`localize_values`)."""
    row = np.ascontiguousarray(digests, dtype=np.int64).reshape(-1)
    if row.size <= SKETCH_BUCKETS:  # a bucket per digest (a small model): the digest is the bucket's own
        column = np.full(SKETCH_BUCKETS, _EMPTY_BUCKET, dtype=np.int64)
        column[: row.size] = row
    else:
        data = row.tobytes()  # slices of bytes: no array per bucket
        hash64 = xxhash.xxh3_64_intdigest
        full = [hash64(data[cut]) >> 1 for cut in _cuts(len(data))]
        full += [_EMPTY_BUCKET] * (SKETCH_BUCKETS - len(full))  # the buckets past the column's end
        column = np.array(full, dtype=np.int64)
    return (column & 0xFF).astype(np.uint8).view(np.int64), column


def _candidates(sketches: np.ndarray) -> list[int]:
    """The buckets whose sketches differ between ranks (``sketches``: ``[world, 4]`` int64)."""
    table = np.ascontiguousarray(sketches).view(np.uint8)
    return np.flatnonzero((table != table[0]).any(axis=0)).tolist()


_IN_SYNC = json.dumps({"s": "in_sync", "f": [], "x": False}).encode()
"""The healthy answer, said and read without numpy or json: every rank's summary the same bytes."""


def _judge(parts: list[bytes]) -> bytes:
    first = parts[0]
    if (
        parts.count(first) == len(parts)
        and len(first) >= 8 * len(SUMMARY_FIELDS)
        and int.from_bytes(first[:8], sys.byteorder, signed=True) != PROTOCOL_FAILED
    ):
        return _IN_SYNC
    if len({len(p) for p in parts}) > 1:  # another protocol version: its summary has another length
        return json.dumps({"s": "out_of_step", "f": ["protocol"], "x": False}).encode()
    table = np.frombuffer(b"".join(parts), dtype=np.int64).reshape(len(parts), -1)
    v = judge_summaries(table[:, : len(SUMMARY_FIELDS)])
    answer = {"s": v.status, "f": list(v.differing_fields), "x": bool((table[:, 0] == PROTOCOL_FAILED).any())}
    if v.status == "values":
        answer["b"] = _candidates(table[:, len(SUMMARY_FIELDS) :])
    return json.dumps(answer).encode()


def agree(comm: Comm, summary: np.ndarray) -> Agreement:
    """Phase (a): compare every rank's summary (its fields, then the sketch); one small answer per rank."""
    row = np.ascontiguousarray(summary, dtype=np.int64).reshape(-1)
    data = comm.decide(row, _judge, "the audit summary")
    if data == _IN_SYNC:
        return Agreement("in_sync")
    answer = json.loads(data)
    b = answer.get("b")
    return Agreement(answer["s"], tuple(answer["f"]), answer["x"], tuple(b) if b is not None else None)


def _columns(parts: list[bytes]) -> bytes:
    if len({len(p) for p in parts}) > 1:
        raise ValueError("ranks sent per-tensor digest vectors of different lengths")
    world = len(parts)
    table = np.frombuffer(b"".join(parts), dtype=np.int64).reshape(world, -1)
    diffs = compare_digest_table(range(table.shape[1]), table)  # type: ignore[arg-type]
    # Each set of differing ranks is written once, however many columns share it.
    sets: dict[tuple[int, ...], int] = {}
    cols = [[int(d.uid), sets.setdefault(d.ranks, len(sets)), [list(g) for g in d.tie] or None] for d in diffs]
    return json.dumps({"sets": [list(s) for s in sets], "cols": cols}).encode()


BUCKETS_FROM = 256
"""From this many tensors on, a divergence is localized in two rounds (buckets, then their entries)."""


def _bucket_size(n: int) -> int:
    return max(8, math.isqrt(n))  # ~sqrt(n): n/s bucket digests, then s digests per differing bucket


def _differing_buckets(parts: list[bytes]) -> bytes:
    if len({len(p) for p in parts}) > 1:
        raise ValueError("ranks sent bucket digests of different lengths")
    table = np.frombuffer(b"".join(parts), dtype=np.int64).reshape(len(parts), -1)
    return json.dumps(np.flatnonzero((table != table[0]).any(axis=0)).tolist()).encode()


def localize_values(
    comm: Comm, uids: Sequence[str], digests: np.ndarray, candidates: Sequence[int] | None, full: np.ndarray
) -> list[ValueDiff]:
    """Phase (b) after the summary's sketch: only the candidate buckets' tensors are compared, with a check
    that every other bucket agrees (its full digests, hashed: one word). A sketch that hid a differing
    bucket (one chance in 256 per differing bucket) fails the check on every rank alike, and every tensor
    is compared then: two rounds more, never a tensor missed.
    """
    row = np.ascontiguousarray(digests, dtype=np.int64).reshape(-1)
    if candidates is None or not comm.distributed:
        return compare_columns(comm, uids, row)
    size = -(-row.size // SKETCH_BUCKETS) or 1
    picked = [j for b in candidates for j in range(b * size, min(row.size, (b + 1) * size))]
    others = np.delete(full, list(candidates))
    check = xxhash.xxh3_64_intdigest(others.tobytes()) >> 1
    found = compare_columns(comm, [uids[j] for j in picked], row[picked], check=check)
    return found if found is not None else compare_columns(comm, uids, row)


def _checked(rule: Any) -> Any:
    """``rule`` on every rank's bytes but its last word, which must be the same everywhere (else ``b"!"``)."""

    def checked(parts: list[bytes]) -> bytes:
        if len({p[-8:] for p in parts}) > 1:
            return b"!"
        return rule([p[:-8] for p in parts])

    return checked


def compare_columns(comm: Comm, uids: Sequence[str], digests: np.ndarray, check: int | None = None) -> Any:
    """Phase (b): which tensors differ, with their reference and differing ranks, on every rank.

    From :data:`BUCKETS_FROM` tensors on, in two rounds, so that the bytes through the coordinator grow
    with the ranks and with what differs, not with the number of tensors: each rank sends one digest per
    bucket of about sqrt(n) tensors; every rank learns the differing buckets; then each sends only those
    buckets' digests. The coordinator finds each column's majority; each rank receives only the differing
    columns, each set of differing ranks once. ``check``: a word that must be the same on every rank,
    sent with the first round; ``None`` comes back on every rank when it is not (see :func:`localize_values`).
    """
    row = np.ascontiguousarray(digests, dtype=np.int64).reshape(-1)
    word = [] if check is None else [check]
    if row.size >= BUCKETS_FROM and comm.distributed:
        size = _bucket_size(row.size)
        buckets = np.array(
            [xxhash.xxh3_64_intdigest(row[i : i + size]) >> 1 for i in range(0, row.size, size)] + word,
            dtype=np.int64,
        )
        rule = _checked(_differing_buckets) if word else _differing_buckets
        answer = comm.decide(buckets, rule, "the bucket digests")
        if answer == b"!":
            return None
        picked = [j for b in json.loads(answer) for j in range(b * size, min(row.size, (b + 1) * size))]
        return _compare_picked(comm, [uids[j] for j in picked], row[picked])
    return _compare_picked(comm, uids, row, word)


def _compare_picked(comm: Comm, uids: Sequence[str], row: np.ndarray, word: list[int] | None = None) -> Any:
    payload = np.concatenate([row, np.array(word or [], dtype=np.int64)])
    raw = comm.decide(payload, _checked(_columns) if word else _columns, "the per-tensor digests")
    if raw == b"!":
        return None
    answer = json.loads(raw)
    sets = [tuple(s) for s in answer["sets"]]
    out = []
    for j, k, tie in answer["cols"]:
        odd = set(sets[k])
        ref = tuple(r for r in range(comm.world_size) if r not in odd)
        out.append(ValueDiff(uids[j], ref, sets[k], tie=tuple(tuple(g) for g in tie or ())))
    return out


def _structures(parts: list[bytes]) -> bytes:
    manifests = [json.loads(p) for p in parts]
    structure, values = compare_manifests(manifests)
    return json.dumps(
        {
            "s": [
                [d.uid, d.kind, d.name, d.reference_ranks, d.ranks, d.shape, d.dtype, d.detail, d.tie]
                for d in structure
            ],
            "v": [[d.uid, d.reference_ranks, d.ranks, d.peer_set, d.tie] for d in values],
            "c": union_counts(manifests, KINDS),  # counted over the union: the same ``checked`` everywhere
        }
    ).encode()


def compare_structures(
    comm: Comm, rows: list[list[Any]]
) -> tuple[list[StructureDiff], list[ValueDiff], dict[str, int]]:
    """Phase (c): each rank's manifest rows ``[kind, name, dtype, shape, digest]`` compared by the
    coordinator; every rank receives the differences only, and the tensors per kind over the union of
    the manifests (the same ``checked`` on every rank)."""
    answer = json.loads(comm.decide(json.dumps(rows).encode(), _structures, "the manifests"))
    structure = [
        StructureDiff(
            uid,
            kind,
            name,
            tuple(ref),
            tuple(odd),
            tuple(shape) if shape is not None else None,
            dtype,
            detail,
            tuple(tuple(g) for g in tie),
        )
        for uid, kind, name, ref, odd, shape, dtype, detail, tie in answer["s"]
    ]
    values = [
        ValueDiff(
            uid, tuple(ref), tuple(odd), tuple(peer_set) if peer_set is not None else None, tuple(map(tuple, tie))
        )
        for uid, ref, odd, peer_set, tie in answer["v"]
    ]
    return structure, values, answer["c"]
