"""The one reader of every file this library opens: checkpoints, sidecars, RNG files, the files of DCP,
DeepSpeed and Hugging Face folders. Nothing it reads can execute code.

- :func:`load_checkpoint`: a ``torch.save`` file with ``torch.load(weights_only=True)`` onto the CPU, with
  one allow-list beyond PyTorch's own: the numpy types an RNG state is saved with (``np.random.get_state()``
  is a tuple holding a ``uint32`` array; the Hugging Face Trainer's ``rng_state_{rank}.pth`` and a Lightning
  module's ``on_save_checkpoint`` store it that way). A file that needs anything else is refused
  (:class:`UnsafeCheckpointError`, naming the file and what it asked for), never loaded unsafely; a file
  that is no checkpoint at all (a report, a text, an image) is refused in one plain line.
- :func:`load_tensors`: a ``.safetensors`` file (no code by design) or, else, :func:`load_checkpoint`.
- :func:`read_json`: a JSON file (sidecars, ``trainer_state.json``): a regular file of bounded size, parsed
  with ``json.loads`` only; nesting too deep or a number too long is an error naming the file.

>>> import os, tempfile, torch
>>> path = os.path.join(tempfile.mkdtemp(), "rng_state_0.pth")
>>> np = __import__("numpy")
>>> torch.save({"cpu": torch.get_rng_state(), "numpy": np.random.get_state()}, path)
>>> sorted(load_checkpoint(path))
['cpu', 'numpy']
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from weightsync_audit.errors import CheckpointError, UnsafeCheckpointError

__all__ = ["CheckpointError", "UnsafeCheckpointError", "load_checkpoint", "load_tensors", "read_json"]

MAX_JSON_BYTES = 512 << 20
"""The largest JSON file read (a sidecar of a million tensors is about 100 MiB)."""


def regular_file(path: str | os.PathLike[str], what: str = "checkpoint file") -> Path:
    """``path`` as a :class:`Path` when it is a regular file; else :class:`CheckpointError` saying what it is
    (no such file, a folder, a FIFO or device, which is never opened: reading one could wait forever)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    if p.is_dir():
        raise CheckpointError(f"{p}: is a folder, expected a {what}")
    if not p.is_file():
        raise CheckpointError(f"{p}: not a regular file (a FIFO, socket or device); give a {what}")
    return p


def _rng_allow_list() -> list[Any]:
    """The numpy types an RNG state is pickled with, under the names numpy 1 and numpy 2 write them: the
    array rebuilder, ``ndarray``, ``dtype`` and the numeric dtype classes, and numpy's scalar rebuilder.
    Each builds numbers only. Empty when numpy is not imported (a file holding numpy state then refuses)."""
    np = sys.modules.get("numpy")
    if np is None:
        try:
            import numpy as np  # torch installs it; a process without it reads no numpy state
        except ImportError:
            return []
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    out: list[Any] = [np.ndarray, np.dtype]
    for fn in ("_reconstruct", "scalar"):
        obj = getattr(multiarray, fn)
        out += [(obj, f"numpy._core.multiarray.{fn}"), (obj, f"numpy.core.multiarray.{fn}")]
    numeric = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
    numeric += (np.float16, np.float32, np.float64, np.complex64, np.complex128)
    out += list(dict.fromkeys(type(np.dtype(t)) for t in numeric))
    return out


@contextlib.contextmanager
def _allowed() -> Iterator[None]:
    """PyTorch's weights-only allow-list plus :func:`_rng_allow_list`, for this load only (the process-wide
    list the user may have set is left as it was)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the refusal below says it all
        with torch.serialization.safe_globals(_rng_allow_list()):
            yield


def load_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Load one ``torch.save`` file with ``weights_only=True`` onto the CPU; refuse anything that needs code.

    Raises :class:`UnsafeCheckpointError` for a file whose unpickling would import or call something outside
    the allow-list (PyTorch's, and numpy's RNG-state types), and :class:`CheckpointError` for any other
    unreadable file; each names the file.
    """
    p = regular_file(path)
    _check_looks_like_a_checkpoint(p)
    try:
        with _allowed():
            return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "weights_only" in text or "Weights only" in text or "Unsupported" in text:
            glob = re.search(r"GLOBAL ([\w.]+)", text)
            operand = re.search(r"Unsupported operand (\d+)", text)
            if glob:
                what = f" (it asks for {glob.group(1)})"
            elif operand:
                what = f" (pickle instruction {operand.group(1)} is not allowed)"
            else:
                what = ""
            raise UnsafeCheckpointError(
                f"{p}: refused: loading it would need code from outside PyTorch's weights-only allow-list{what}; "
                "weightsync-audit loads with weights_only=True and never executes a file's code"
            ) from None
        raise CheckpointError(f"{p}: not a readable PyTorch checkpoint ({_first_line(text)})") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, TypeError, IndexError) as exc:
        why = _first_line(str(exc)) if isinstance(exc, (RuntimeError, OSError)) else ""
        raise CheckpointError(
            f"{p}: not a readable PyTorch checkpoint ({why or 'neither a torch.save file nor a pickle of tensors'})"
        ) from None


def load_tensors(path: str | os.PathLike[str]) -> Any:
    """The tensors of one file: a ``.safetensors`` file by safetensors (which holds no code), any other by
    :func:`load_checkpoint`."""
    p = regular_file(path)
    if p.suffix != ".safetensors":
        return load_checkpoint(p)
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise CheckpointError(f"{p}: reading a .safetensors file needs the safetensors package") from None
    try:
        return load_file(str(p))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types: said as unreadable
        raise CheckpointError(f"{p}: not a readable safetensors file ({_first_line(str(exc))})") from None


def read_json(path: str | os.PathLike[str], what: str = "JSON file") -> Any:
    """The JSON value in ``path`` (``json.loads`` only, never anything evaluated); :class:`CheckpointError`
    naming the file when it is no regular file, larger than :data:`MAX_JSON_BYTES`, not UTF-8 JSON, nested
    too deep or holding a number too long to read."""
    p = regular_file(path, what)
    try:
        size = p.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{p}: unreadable {what} ({size} bytes, more than {MAX_JSON_BYTES >> 20} MiB)")
        return json.loads(p.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise CheckpointError(f"{p}: unreadable {what} ({exc.strerror or exc})") from None
    except RecursionError:
        raise CheckpointError(f"{p}: unreadable {what} (nested too deep)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a number past Python's digit limit
        raise CheckpointError(f"{p}: unreadable {what} ({_first_line(str(exc))[:200]})") from None


def _check_looks_like_a_checkpoint(p: Path) -> None:
    """Refuse, in one plain line, a file that is no ``torch.save`` output at all (a report, a text, an image).

    ``torch.save`` writes a zip archive (``PK``), or with ``_use_new_zipfile_serialization=False`` a
    pickle of protocol 2 or later (first byte ``0x80``); very old releases wrote a tar archive.
    """
    try:
        with open(p, "rb") as f:
            head = f.read(512)
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    if head.startswith((b"PK\x03\x04", b"\x80")) or head[257:262] == b"ustar":
        return
    if not head:
        why = "the file is empty"
    elif head.lstrip()[:1] in (b"{", b"["):
        why = "it is JSON text (an audit report? read it with: weightsync-audit check FILE)"
    elif b"\0" not in head:
        why = "it is a text file"
    else:
        why = "its bytes are neither a zip archive nor a pickle, as torch.save writes"
    raise CheckpointError(f"{p}: not a PyTorch checkpoint: {why}")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
