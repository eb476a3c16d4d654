"""Compare two checkpoints tensor by tensor, without ever executing code from a file.

Accepted inputs: a Lightning ``.ckpt``, a file written by ``torch.save`` (a ``state_dict``, or any
nesting of dicts, lists and tensors), or a folder of such files (one per rank, say). Files are loaded
with ``torch.load(..., weights_only=True)``: a file whose unpickling would need to import and call code
is refused with :class:`UnsafeCheckpointError`, and nothing in it runs. Only regular files are opened
(a FIFO or device is refused, never waited on), and a tensor whose strides make it expand past
:data:`MAX_EXPANDED_BYTES` beyond its stored bytes (a stride-0 tensor of 2^28 elements in a 1.6 KB file)
is refused by name instead of being allocated.

Nested containers are flattened to dotted names (``state_dict.backbone.weight``,
``optimizer_states.0.state.0.exp_avg``). When exactly one side is a Lightning checkpoint and the other
is not, the Lightning side's ``state_dict`` is compared with the other, so a ``.ckpt`` can be checked
against a plain ``model.state_dict()`` file.

>>> import os, tempfile, torch
>>> d = tempfile.mkdtemp()
>>> torch.save({"w": torch.ones(2)}, os.path.join(d, "a.pt"))
>>> torch.save({"w": torch.tensor([1.0, 1.5])}, os.path.join(d, "b.pt"))
>>> result = diff_checkpoints(os.path.join(d, "a.pt"), os.path.join(d, "b.pt"))
>>> result.identical, result.pairs[0].entries[0].max_abs_diff
(False, 0.5)
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from weightsync_audit.engine.checkpoints.load import load_checkpoint
from weightsync_audit.engine.checkpoints.sidecar_diff import diff_sidecars
from weightsync_audit.engine.measure.gaps import max_abs_diff
from weightsync_audit.errors import CheckpointError, UnsafeCheckpointError

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "CheckpointError",
    "UnsafeCheckpointError",
    "EntryDiff",
    "PairDiff",
    "DiffResult",
    "load_checkpoint",
    "flatten",
    "diff_flat",
    "diff_checkpoints",
    "diff_sidecars",
]

CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".tar")
"""File endings picked up when a folder is given."""

_STATUSES = ("missing", "extra", "shape", "dtype", "values")

MAX_EXPANDED_BYTES = 256 << 20
"""How far past its stored bytes a tensor may expand (overlapping strides) before it is refused."""


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


# -- comparing ---------------------------------------------------------------------------------


@dataclass(slots=True)
class EntryDiff:
    """One name that differs between A and B."""

    name: str
    status: str
    """``missing`` (only in A), ``extra`` (only in B), ``shape``, ``dtype`` or ``values``."""
    a: str | None = None
    """A's side in words: ``float32 16x32`` for a tensor, the value's repr otherwise."""
    b: str | None = None
    max_abs_diff: float | None = None
    changed: int | None = None
    """Elements whose bits differ (tensors of equal shape)."""
    numel: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Every field, by name (the ``--json`` row)."""
        return asdict(self)


@dataclass(slots=True)
class PairDiff:
    """The comparison of one file of A with one file of B."""

    a: str | None
    b: str | None
    compared: int = 0
    """Names present on both sides."""
    same: int = 0
    entries: list[EntryDiff] = field(default_factory=list)
    note: str | None = None
    within_atol: list[EntryDiff] = field(default_factory=list)
    """Tensors whose bits differ but whose max |diff| is within ``atol``: counted equal, not identical."""

    @property
    def identical(self) -> bool:
        """Nothing differs beyond ``atol`` (see :attr:`exact` for equal bits)."""
        return not self.entries and self.a is not None and self.b is not None

    @property
    def exact(self) -> bool:
        """Every shared entry has equal bits: identical, and nothing merely within ``atol``."""
        return self.identical and not self.within_atol

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "exact": self.exact,
            "within_atol": len(self.within_atol),
            "compared": self.compared,
            "same": self.same,
            "note": self.note,
            "differences": [e.to_dict() for e in self.entries],
        }


@dataclass(slots=True)
class DiffResult:
    """Every pair of files compared; ``identical`` when all of them are."""

    pairs: list[PairDiff] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return all(p.identical for p in self.pairs)

    def to_dict(self) -> dict[str, Any]:
        return {"identical": self.identical, "pairs": [p.to_dict() for p in self.pairs]}


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')} {'x'.join(map(str, v.shape)) or 'scalar'}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of the same width, one row of words per element (for bitwise equality)."""
    t = t.detach().contiguous().reshape(-1)
    size = t.element_size()
    if size in (1, 2, 4, 8):
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        return t.view(view).reshape(-1, 1)
    return t.view(torch.uint8).reshape(t.numel(), size)


def check_expansion(name: str, t: torch.Tensor, limit: int = MAX_EXPANDED_BYTES) -> None:
    """Refuse a tensor whose elements take far more bytes than its storage holds (stride tricks).

    Comparing it would materialise every element; a hostile file can ask for gigabytes that way.
    """
    if t.layout != torch.strided:
        return
    need = t.numel() * t.element_size()
    try:
        stored = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        stored = 0
    if need - stored > limit:
        raise CheckpointError(
            f"tensor {name!r}: {t.numel()} elements ({need / 2**30:.1f} GiB) over {stored} stored bytes "
            f"(strides {list(t.stride())}): expanding it would exceed the limit of {limit >> 20} MiB; refused"
        )


def _compare_tensors(
    name: str, a: torch.Tensor, b: torch.Tensor, atol: float | None, within: list[EntryDiff] | None = None
) -> EntryDiff | None:
    check_expansion(name, a)
    check_expansion(name, b)
    if a.layout != torch.strided or b.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    if tuple(a.shape) != tuple(b.shape):
        return EntryDiff(name, "shape", _describe(a), _describe(b))
    numel = a.numel()
    if a.dtype != b.dtype:
        gap = None
        if numel and not (a.is_complex() or b.is_complex()):
            gap = max_abs_diff(a.to(torch.float64), b.to(torch.float64))
        return EntryDiff(name, "dtype", _describe(a), _describe(b), gap, None, numel)
    if numel == 0:
        return None
    unequal = (_bits(a) != _bits(b)).any(dim=1)
    changed = int(unequal.sum())
    if changed == 0:
        return None
    gap = max_abs_diff(a, b)
    entry = EntryDiff(name, "values", _describe(a), _describe(b), gap, changed, numel)
    if atol is not None and gap <= atol:
        if within is not None:
            within.append(entry)
        return None
    return entry


def _equal_values(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a and b != b:
        return True  # both NaN
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - exotic objects: fall back to their text
        return repr(a) == repr(b)


def diff_flat(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    *,
    atol: float | None = None,
    exclude: Sequence[str] = (),
    within: list[EntryDiff] | None = None,
) -> tuple[int, int, list[EntryDiff]]:
    """Compare two flattened checkpoints: (names compared, names equal, differences in A's order).

    ``atol``: tensors whose max |diff| is at most this count as equal (default: equal bits only).
    ``exclude``: glob patterns over names to leave out.
    ``within``: when given, the tensors that differ but only within ``atol`` are appended to it.
    """

    def keep(n: str) -> bool:
        return not any(fnmatch.fnmatchcase(n, pat) for pat in exclude)

    names_a = [n for n in a if keep(n)]
    names_b = [n for n in b if keep(n)]
    in_b = set(names_b)
    entries: list[EntryDiff] = []
    compared = same = 0
    for name in names_a:
        va = a[name]
        if name not in in_b:
            entries.append(EntryDiff(name, "missing", _describe(va), None))
            continue
        vb = b[name]
        compared += 1
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            d = _compare_tensors(name, va, vb, atol, within)
        elif isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor):
            d = EntryDiff(name, "dtype", _describe(va), _describe(vb))
        elif _equal_values(va, vb):
            d = None
        else:
            gap = None
            num = (int, float)
            if isinstance(va, num) and isinstance(vb, num) and not isinstance(va, bool) and not isinstance(vb, bool):
                gap = abs(float(va) - float(vb))
            d = EntryDiff(name, "values", _describe(va), _describe(vb), gap)
        if d is None:
            same += 1
        else:
            entries.append(d)
    in_a = set(names_a)
    entries.extend(EntryDiff(n, "extra", None, _describe(b[n])) for n in names_b if n not in in_a)
    return compared, same, entries


def _natural_key(p: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def _files_in(folder: Path) -> list[Path]:
    files = [p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in CHECKPOINT_SUFFIXES]
    if not files:
        raise CheckpointError(f"{folder}: the folder holds no checkpoint files ({', '.join(CHECKPOINT_SUFFIXES)})")
    return sorted(files, key=_natural_key)


def _diff_files(a: Path, b: Path, atol: float | None, exclude: Sequence[str]) -> PairDiff:
    oa, ob = load_checkpoint(a), load_checkpoint(b)
    note = None
    la, lb = is_lightning_checkpoint(oa), is_lightning_checkpoint(ob)
    if la and not lb:
        oa, note = oa["state_dict"], f"compared the state_dict of the Lightning checkpoint {a.name} with {b.name}"
    elif lb and not la:
        ob, note = ob["state_dict"], f"compared {a.name} with the state_dict of the Lightning checkpoint {b.name}"
    within: list[EntryDiff] = []
    compared, same, entries = diff_flat(flatten(oa), flatten(ob), atol=atol, exclude=exclude, within=within)
    return PairDiff(str(a), str(b), compared, same, entries, note, within)


def diff_checkpoints(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str] | None = None,
    *,
    atol: float | None = None,
    exclude: Iterable[str] = (),
) -> DiffResult:
    """Compare checkpoints A and B; either may be a file or a folder of files.

    - file and file: compared directly;
    - folder and folder: files paired by their path inside each folder (an unpaired file is a difference);
    - folder and file: every file of the folder against the file;
    - one folder alone (``b=None``): every file against the first (``rank0.pt`` before ``rank1.pt``).
    """
    exclude = tuple(exclude)
    pa = Path(a)
    if not pa.exists():
        raise CheckpointError(f"{pa}: no such file or folder")
    if b is None:
        if not pa.is_dir():
            raise CheckpointError(f"{pa}: give two checkpoints, or one folder of per-rank checkpoints")
        files = _files_in(pa)
        if len(files) < 2:
            raise CheckpointError(f"{pa}: the folder holds only {files[0].name}; nothing to compare it with")
        return DiffResult([_diff_files(files[0], f, atol, exclude) for f in files[1:]])
    pb = Path(b)
    if not pb.exists():
        raise CheckpointError(f"{pb}: no such file or folder")
    if pa.is_dir() and pb.is_dir():
        fa = {f.relative_to(pa): f for f in _files_in(pa)}
        fb = {f.relative_to(pb): f for f in _files_in(pb)}
        pairs = []
        for rel in sorted(set(fa) | set(fb), key=_natural_key):
            if rel in fa and rel in fb:
                pairs.append(_diff_files(fa[rel], fb[rel], atol, exclude))
            elif rel in fa:
                pairs.append(PairDiff(str(fa[rel]), None, note=f"{rel} is missing from {pb}"))
            else:
                pairs.append(PairDiff(None, str(fb[rel]), note=f"{rel} is only in {pb}"))
        return DiffResult(pairs)
    if pa.is_dir():
        return DiffResult([_diff_files(f, pb, atol, exclude) for f in _files_in(pa)])
    if pb.is_dir():
        return DiffResult([_diff_files(pa, f, atol, exclude) for f in _files_in(pb)])
    return DiffResult([_diff_files(pa, pb, atol, exclude)])
