"""How audit messages are framed: a fixed-size header that names the exchange, and its body.

A message larger than the receive buffer aborts the receiving *process* in gloo, and ranks at different
points of the protocol would send messages of different sizes; so every message starts with a frame of
``REQ_WORDS`` int64 words (magic, exchange number, hash and text of the exchange's name, body length,
and up to ``INLINE_BYTES`` of the body), and a longer body is received into a buffer of exactly the
announced length. The coordinator's reply is framed the same way in ``REPLY_WORDS`` words (magic,
exchange number, status, body length, and up to ``INLINE_BYTES`` of the body), whatever the number of
ranks, so a healthy audit sends a fixed number of bytes per rank. Frames are received into buffers of the
largest frame's size and sent at their own length (:func:`used_words`): an exchange of up to a kilobyte
each way is one message up and one down, which on the wire costs far less than a second message (each
gloo message brings its own handshake and acknowledgements: about 500 bytes on loopback).
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

__all__ = [
    "INLINE_BYTES",
    "INLINE_FLAG",
    "LEGACY_INLINE_BYTES",
    "MAGIC",
    "MISSING",
    "OK",
    "OUT_OF_STEP",
    "REPLY_WORDS",
    "REQ_WORDS",
    "RULE_FAILED",
    "WHAT_BYTES",
    "as_u8",
    "compact_rows",
    "expand_rows",
    "join_parts",
    "length_word",
    "read_length",
    "split_parts",
    "used_words",
    "what_words",
    "words_text",
]

MAGIC = 0x5753_4146  # 'WSAF'
WHAT_BYTES = 48
INLINE_BYTES = 1024
LEGACY_INLINE_BYTES = 128
"""What a frame of the previous release carried inline; a longer body came as a message of its own."""
INLINE_FLAG = 1 << 62
"""Set in a frame's length word when a body longer than ``LEGACY_INLINE_BYTES`` rides the frame, so that a
frame of the previous release (no flag, a body over 128 bytes sent apart) is still read right."""
REQ_WORDS = 4 + WHAT_BYTES // 8 + INLINE_BYTES // 8  # magic, seq, what hash, nbytes, what, inline
REPLY_WORDS = 4 + INLINE_BYTES // 8  # magic, seq, status, nbytes, inline

OK, MISSING, OUT_OF_STEP, RULE_FAILED = 0, 1, 2, 3


def what_words(what: str) -> tuple[int, np.ndarray]:
    raw = what.encode("utf-8", "replace")[:WHAT_BYTES]
    words = np.zeros(WHAT_BYTES // 8, dtype=np.int64)
    words.view(np.uint8)[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return xxhash.xxh3_64_intdigest(what.encode("utf-8", "replace")) >> 1, words


def words_text(words: np.ndarray) -> str:
    return words.view(np.uint8).tobytes().rstrip(b"\0").decode("utf-8", "replace")


def length_word(nbytes: int, inline: bool) -> int:
    """A frame's length word: the body's length, flagged when it rides the frame beyond what the previous
    release carried inline."""
    return nbytes | (INLINE_FLAG if inline and nbytes > LEGACY_INLINE_BYTES else 0)


def read_length(word: int) -> tuple[int, bool]:
    """(the body's length, whether it rides the frame) from a frame's length word."""
    nbytes = word & ~INLINE_FLAG
    return nbytes, bool(word & INLINE_FLAG) or nbytes <= LEGACY_INLINE_BYTES


def used_words(header_words: int, inline_bytes: int) -> int:
    """The words of a frame actually sent: its header and the inline body, rounded up to a word.

    A receive buffer may be larger than the message that fills it (gloo delivers a shorter message
    whole; only a longer one aborts the process), so every frame is received into a buffer of the
    largest frame's size and sent at its own length: a short exchange costs its own bytes only.
    """
    return header_words + -(-inline_bytes // 8)


def as_u8(data: bytes | bytearray | memoryview | np.ndarray) -> torch.Tensor:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1).tobytes()
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def join_parts(parts: list[bytes]) -> bytes:
    """Every rank's bytes in one message: their lengths (int64 each), then the bytes in rank order."""
    return np.array([len(p) for p in parts], dtype=np.int64).tobytes() + b"".join(parts)


def split_parts(data: bytes, world: int) -> list[bytes]:
    lengths = np.frombuffer(data[: 8 * world], dtype=np.int64).tolist()
    out, pos = [], 8 * world
    for n in lengths:
        out.append(data[pos : pos + n])
        pos += n
    return out


def compact_rows(parts: list[bytes]) -> bytes:
    """Every rank's int64 row, said compactly: per column the value most ranks hold (the column's
    median, which is any strict majority's value), then only the cells that differ from it (flat index,
    value). What comes back grows with what differs, not with the number of ranks. Rows of unequal
    lengths come back as ``[-1, length of each]`` so that every rank can name the ranks out of step."""
    sizes = [len(p) // 8 for p in parts]
    if len(set(sizes)) != 1 or any(len(p) % 8 for p in parts):
        return np.array([-1, *sizes], dtype=np.int64).tobytes()
    table = np.frombuffer(b"".join(parts), dtype=np.int64).reshape(len(parts), sizes[0])
    base = np.sort(table, axis=0)[len(parts) // 2] if table.size else np.zeros(sizes[0], dtype=np.int64)
    flat = np.flatnonzero(table != base)
    return np.concatenate([[sizes[0]], base, flat, table.reshape(-1)[flat]]).astype(np.int64).tobytes()


def expand_rows(data: bytes, world: int) -> np.ndarray | list[int]:
    """The ``[world, L]`` table that :func:`compact_rows` said; the rows' lengths when they differed."""
    words = np.frombuffer(data, dtype=np.int64)
    if words[0] < 0:
        return words[1:].tolist()
    n = int(words[0])
    base, rest = words[1 : 1 + n], words[1 + n :]
    table = np.array(np.tile(base, (world, 1)))  # writable even when empty (np.tile then hands back a view)
    k = rest.size // 2
    table.reshape(-1)[rest[:k]] = rest[k:]
    return table
