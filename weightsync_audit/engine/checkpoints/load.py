"""The one reader of every file this library opens: checkpoints, sidecars, RNG files, the files of DCP,
DeepSpeed and Hugging Face folders. Nothing it reads can execute code.

- :func:`load_checkpoint`: a ``torch.save`` file with ``torch.load(weights_only=True)`` onto the CPU, with
  one allow-list beyond PyTorch's own: the numpy types an RNG state is saved with (``np.random.get_state()``
  is a tuple holding a ``uint32`` array; the Hugging Face Trainer's ``rng_state_{rank}.pth`` and a Lightning
  module's ``on_save_checkpoint`` store it that way). A file that needs anything else is refused
  (:class:`UnsafeCheckpointError`, naming the file and what it asked for), never loaded unsafely; a file
  that is no checkpoint at all (a report, a text, an image) is refused in one plain line.
- :func:`stream_tensors`: the tensors of a ``.safetensors`` file (no code by design; read by its header, each
  tensor a view of the file's memory-mapped pages) or of a ``torch.save`` file (:func:`load_checkpoint`,
  memory-mapped), read as ``diff`` and ``verify`` reach each tensor: the page cache holds them, not the heap.
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
import math
import mmap
import os
import pickle
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from weightsync_audit.errors import CheckpointError, UnsafeCheckpointError

__all__ = [
    "LazyTensor",
    "UnreadableCheckpointError",
    "flatten",
    "is_lightning_checkpoint",
    "load_checkpoint",
    "open_unit",
    "read_value",
    "stream_flat",
    "read_json",
    "safetensors_header",
    "stream_tensors",
]


class UnreadableCheckpointError(CheckpointError):
    """A file that is a checkpoint by its first bytes (or its name) but cannot be read whole: truncated or
    damaged. Beside a readable counterpart it is a difference (exit 1), never bad input."""


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


def load_checkpoint(path: str | os.PathLike[str], *, mmap: bool = False) -> Any:
    """Load one ``torch.save`` file with ``weights_only=True`` onto the CPU; refuse anything that needs code.

    Raises :class:`UnsafeCheckpointError` for a file whose unpickling would import or call something outside
    the allow-list (PyTorch's, and numpy's RNG-state types), and :class:`CheckpointError` for any other
    unreadable file; each names the file.
    """
    p = regular_file(path)
    zipped = _check_looks_like_a_checkpoint(p)
    try:
        with _allowed():
            return torch.load(p, map_location="cpu", weights_only=True, mmap=mmap and zipped)
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
        raise UnreadableCheckpointError(f"{p}: not a readable PyTorch checkpoint ({_first_line(text)})") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, TypeError, IndexError) as exc:
        why = _first_line(str(exc)) if isinstance(exc, (RuntimeError, OSError)) else ""
        raise UnreadableCheckpointError(
            f"{p}: not a readable PyTorch checkpoint ({why or 'neither a torch.save file nor a pickle of tensors'})"
        ) from None


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "C64": torch.complex64,
}  # fmt: skip


def safetensors_header(path: str | os.PathLike[str]) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """Name -> ``(dtype, shape, start, end)`` (byte offsets in the file) of a ``.safetensors`` file, read from
    its header alone and checked against the file's size: a truncated or malformed file is a
    :class:`CheckpointError` naming it (and its sizes), before any tensor is read."""
    p = regular_file(path)
    size = p.stat().st_size

    def bad(why: str) -> CheckpointError:
        return UnreadableCheckpointError(f"{p}: not a readable safetensors file ({why})")

    with open(p, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if n < 0 or n > min(size - 8, MAX_JSON_BYTES):
            raise bad(f"its header claims {n} bytes; the file has {size}")
        try:
            doc = json.loads(f.read(n))
        except (ValueError, RecursionError) as exc:
            raise bad(f"header: {_first_line(str(exc))[:120]}") from None
    out = {}
    for name, e in (doc if isinstance(doc, dict) else {None: None}).items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = _ST_DTYPES[e["dtype"]], [int(x) for x in e["shape"]], e["data_offsets"]
            ok = 0 <= a <= b and 8 + n + b <= size and b - a == math.prod(shape) * dtype.itemsize
        except (KeyError, TypeError, ValueError):
            raise bad(f"header entry {str(name)[:80]!r}") from None
        if not ok:
            raise bad(f"{name!r} lies at bytes {a}..{b} past a {n}-byte header; the file has {size} bytes")
        out[str(name)] = (dtype, shape, 8 + n + a, 8 + n + b)
    return out


class LazyTensor:
    """One tensor of a ``.safetensors`` file, made when :meth:`read` is called: a view of the file's pages
    (memory-mapped copy-on-write: the kernel's page cache, read as the tensor is; never written back)."""

    __slots__ = ("dtype", "end", "mapped", "shape", "start")

    def __init__(self, mapped: Any, dtype: torch.dtype, shape: list[int], start: int, end: int) -> None:
        self.mapped, self.dtype, self.shape, self.start, self.end = mapped, dtype, shape, start, end

    def read(self) -> torch.Tensor:
        if self.end == self.start:
            return torch.empty(self.shape, dtype=self.dtype)
        raw = torch.frombuffer(self.mapped, dtype=torch.uint8, count=self.end - self.start, offset=self.start)
        if self.start % self.dtype.itemsize:  # not aligned for its dtype: copied
            raw = raw.clone()
        return raw.view(self.dtype).reshape(self.shape)


def stream_tensors(path: str | os.PathLike[str]) -> Any:
    """The tensors of one file, read lazily: a ``.safetensors`` file as name -> a reader whose ``read()`` gives
    the tensor (one at a time in memory); any other as :func:`load_checkpoint` memory-mapped."""
    p = regular_file(path)
    if p.suffix != ".safetensors":
        return load_checkpoint(p, mmap=True)  # pages read as each tensor is: the kernel's cache, not the heap
    header = safetensors_header(p)
    if not any(e[3] > e[2] for e in header.values()):
        return {n: LazyTensor(b"", *e) for n, e in header.items()}
    try:
        with open(p, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{p}: cannot be read ({exc})") from None
    return {n: LazyTensor(mapped, *e) for n, e in header.items()}


def is_lightning_checkpoint(obj: Any) -> bool:
    """True for the dict Lightning saves (a ``state_dict`` next to its version or loop state)."""
    return (
        isinstance(obj, Mapping)
        and isinstance(obj.get("state_dict"), Mapping)
        and any(k in obj for k in ("pytorch-lightning_version", "lightning_version", "loops", "global_step", "epoch"))
    )


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted name -> tensor or plain value, for any nesting of mappings, lists and tuples.

    >>> import torch
    >>> sorted(flatten({"model": {"w": torch.zeros(1)}, "steps": [1, 2]}))
    ['model.w', 'steps.0', 'steps.1']
    """
    out: dict[str, Any] = {}
    _flatten_into(obj, prefix, out)
    return out


def _as_tensor(obj: Any) -> Any:
    """A numpy array (an RNG state's, as the loader allows) as a tensor, compared bit by bit like one; any
    other value as it is."""
    if type(obj).__name__ == "ndarray" and type(obj).__module__ == "numpy":
        try:
            return torch.from_numpy(obj.copy())
        except TypeError:  # a dtype torch has no counterpart for: compared as a value
            return obj
    return obj


def _flatten_into(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    obj = _as_tensor(obj)
    if isinstance(obj, torch.Tensor):
        out[prefix or "(root)"] = obj
    elif isinstance(obj, Mapping):
        if not obj and prefix:
            out[prefix] = {}
        for k, v in obj.items():
            _flatten_into(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        if not obj and prefix:
            out[prefix] = []
        for i, v in enumerate(obj):
            _flatten_into(v, f"{prefix}.{i}" if prefix else str(i), out)
    else:
        out[prefix or "(root)"] = obj


Progress = Callable[[int], None]


def read_value(v: Any, progress: Progress | None) -> Any:
    """A value of a flattened file as itself, a lazy tensor read now (``progress`` told its bytes)."""
    if isinstance(v, LazyTensor):
        v = v.read()
    if progress is not None and isinstance(v, torch.Tensor):
        progress(v.nbytes)
    return v


def open_unit(files: Sequence[Path]) -> tuple[dict[str, Any], bool]:
    """The flattened names -> values, its tensors read lazily, and whether it is a Lightning checkpoint."""
    if len(files) == 1:
        obj = stream_tensors(files[0])
        return flatten(obj), is_lightning_checkpoint(obj)
    out: dict[str, Any] = {}
    for f in files:  # the shards one index names: one set of names
        out.update(flatten(stream_tensors(f)))
    return out, False


def stream_flat(files: Sequence[Path], progress: Progress | None = None) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of every entry of the files (one, or the shards one index names), each tensor read as it is reached."""
    flat, _ = open_unit(files)
    for name in list(flat):
        yield name, read_value(flat.pop(name), progress)


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


def _check_looks_like_a_checkpoint(p: Path) -> bool:
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
        return head.startswith(b"PK")  # a zip archive: memory-mappable
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
