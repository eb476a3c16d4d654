"""The audit's steps for sharded tensors (DTensors): peer keys out, peer sets and shard names back.

Only a manifest holding DTensors takes these steps. Its structure (global shapes and layouts) is the
same on every rank once phase (a) found equal structure digests, so every rank takes the same steps;
each decision below comes from gathered data, never from what one rank holds alone.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from weightsync_audit.channel.star import Comm
from weightsync_audit.engine.agreement.consensus import ValueDiff, compare_digest_table
from weightsync_audit.engine.inventory.manifest import KINDS, Entry
from weightsync_audit.engine.inventory.peers import ALL, unpaired_columns
from weightsync_audit.engine.inventory.replicas.keys import holders_label, unreplicated_label
from weightsync_audit.text import COMPARED_NOTES, NOTHING_COMPARED, NOTHING_TO_AUDIT

__all__ = ["peer_keys", "compare_sharded", "shard_names", "compared_counts", "sharded_notes"]


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
