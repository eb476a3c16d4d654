"""Compare two checkpoints tensor by tensor, without ever executing code from a file.

Accepted inputs: a Lightning ``.ckpt``, a file written by ``torch.save`` (a ``state_dict``, or any
nesting of dicts, lists and tensors), a ``.safetensors`` file, or a folder (per-rank files, a Hugging Face
``checkpoint-N``, a DCP or DeepSpeed folder), read by ``folder.folder_units`` as ``verify`` reads it, one tensor
in memory at a time. Files are loaded with ``torch.load(..., weights_only=True, mmap=True)``: a file whose unpickling would need to import and call code
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

from weightsync_audit.engine.checkpoints.folder import TENSOR_SUFFIXES, Unit, file_digest, folder_units
from weightsync_audit.engine.checkpoints.load import (
    LazyTensor,
    Progress,
    UnreadableCheckpointError,
    open_unit,
    read_value,
    regular_file,
)
from weightsync_audit.engine.measure.gaps import max_abs_diff
from weightsync_audit.errors import CheckpointError, UnsafeCheckpointError

__all__ = [
    "EntryDiff",
    "PairDiff",
    "DiffResult",
    "diff_flat",
    "diff_checkpoints",
]


MAX_EXPANDED_BYTES = 256 << 20
"""How far past its stored bytes a tensor may expand (overlapping strides) before it is refused."""


# -- comparing ---------------------------------------------------------------------------------


@dataclass(slots=True)
class EntryDiff:
    """One name that differs between A and B."""

    name: str
    status: str
    """``missing`` (only in A), ``extra`` (only in B), ``shape``, ``dtype``, ``values``, ``bytes`` (a metadata or
    shard file whose bytes differ) or ``unreadable`` (one side cannot be read whole: truncated, damaged)."""
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
    if isinstance(v, (LazyTensor, torch.Tensor)):
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
    ba, bb = _bits(a), _bits(b)
    if torch.equal(ba, bb):  # the common case, at memory speed, with no temporary the size of the tensor
        return None
    unequal = (ba != bb).any(dim=1)
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
    progress: Progress | None = None,
) -> tuple[int, int, list[EntryDiff]]:
    """Compare two flattened checkpoints: (names compared, names equal, differences in A's order).

    ``atol``: tensors whose max |diff| is at most this count as equal (default: equal bits only).
    ``exclude``: glob patterns over names to leave out.
    ``within``: when given, the tensors that differ but only within ``atol`` are appended to it.
    Lazy tensors (:class:`~weightsync_audit.engine.checkpoints.load.LazyTensor`) are read one pair at a time.
    """

    def keep(n: str) -> bool:
        return not any(fnmatch.fnmatchcase(n, pat) for pat in exclude)

    names_a = [n for n in a if keep(n)]
    names_b = [n for n in b if keep(n)]
    in_b = set(names_b)
    entries: list[EntryDiff] = []
    compared = same = 0
    for name in names_a:
        if name not in in_b:
            entries.append(EntryDiff(name, "missing", _describe(a[name]), None))
            continue
        va, vb = read_value(a[name], progress), read_value(b[name], progress)
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


def _natural_key(p: Any) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def _size(unit: Unit) -> int:
    return sum(f.stat().st_size for f in unit.files)


def _by_bytes(ua: Unit, ub: Unit, progress: Progress | None, note: str | None = None) -> PairDiff:
    """Metadata files, DCP shard files, or files that would need code to load: compared by size and digest."""
    fa = {f.name: f for f in ua.files}
    fb = {f.name: f for f in ub.files}
    pair = PairDiff(str(ua.files[0].parent if ua.kind == "dcp" else ua.files[0]), None, note=note)
    pair.b = str(ub.files[0].parent if ub.kind == "dcp" else ub.files[0])
    for name in sorted(set(fa) | set(fb), key=_natural_key):
        if name not in fb or name not in fa:
            f = fa.get(name) or fb[name]
            status, side = ("missing", "a") if name in fa else ("extra", "b")
            pair.entries.append(EntryDiff(name, status, **{side: f"{f.stat().st_size} bytes"}))
            continue
        pair.compared += 1
        sa, sb = fa[name].stat().st_size, fb[name].stat().st_size
        same = sa == sb and file_digest(fa[name]) == file_digest(fb[name])
        if progress is not None:
            progress(sa + sb)
        if same:
            pair.same += 1
        else:
            pair.entries.append(EntryDiff(name, "bytes", f"{sa} bytes", f"{sb} bytes"))
    return pair


def _diff_units(ua: Unit, ub: Unit, atol: float | None, exclude: Sequence[str], progress: Progress | None,
                folders: bool = False) -> PairDiff:  # fmt: skip
    """Compare one unit of A with one of B. A side that cannot be read whole (truncated, damaged) while the other
    can differs from it (named with both sizes); a file that is no checkpoint or needs code to load is refused."""
    if "bytes" in (ua.kind, ub.kind) or "dcp" in (ua.kind, ub.kind):
        return _by_bytes(ua, ub, progress)
    sides: list[Any] = []
    for u in (ua, ub):
        try:
            sides.append(open_unit(u.files))
        except (UnreadableCheckpointError, UnsafeCheckpointError) as exc:
            sides.append(exc)
    unsafe = [s for s in sides if isinstance(s, UnsafeCheckpointError)]
    if folders and len(unsafe) == 2:  # a folder's file that needs code on both sides (an engine's own): by bytes
        return _by_bytes(ua, ub, progress, note=f"{ua.name}: compared by its bytes (loading it would need code)")
    bad = [s for s in sides if isinstance(s, Exception)]
    if unsafe or len(bad) == 2:
        raise (unsafe or bad)[0]
    if bad:  # one side truncated or damaged, the other read whole: they differ
        entry = EntryDiff(ua.name, "unreadable", f"{_size(ua)} bytes", f"{_size(ub)} bytes")
        return PairDiff(str(ua.files[0]), str(ub.files[0]), 1, 0, [entry], f"not readable whole: {bad[0]}")
    (oa, la), (ob, lb) = sides
    note = None
    if la != lb:  # exactly one side is a Lightning checkpoint: its state_dict is compared with the other
        oa, ob = (_under(oa, "state_dict"), ob) if la else (oa, _under(ob, "state_dict"))
        lit = "the state_dict of the Lightning checkpoint "
        note = f"compared {lit * la}{ua.name} with {lit * lb}{ub.name}"
    within: list[EntryDiff] = []
    compared, same, entries = diff_flat(oa, ob, atol=atol, exclude=exclude, within=within, progress=progress)
    return PairDiff(str(ua.files[0]), str(ub.files[0]), compared, same, entries, note, within)


def _under(flat: dict[str, Any], key: str) -> dict[str, Any]:
    """The entries of a flattened object under ``key.``, named without it."""
    return {n[len(key) + 1 :]: v for n, v in flat.items() if n.startswith(key + ".")}


def _tensor_units(path: Path) -> list[Unit]:
    units = [u for u in folder_units(path) if u.kind == "tensors"]
    if not units:
        raise CheckpointError(f"{path}: the folder holds no checkpoint files ({', '.join(TENSOR_SUFFIXES)})")
    return sorted(units, key=lambda u: _natural_key(u.name))


def diff_checkpoints(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str] | None = None,
    *,
    atol: float | None = None,
    exclude: Iterable[str] = (),
    progress: Progress | None = None,
) -> DiffResult:
    """Compare checkpoints A and B; either may be a file or a folder (read by
    :func:`~weightsync_audit.engine.checkpoints.folder.folder_units`: which files hold tensors, which are
    metadata, compared by their bytes), tensor by tensor, one tensor in memory at a time.

    - file and file: compared directly;
    - folder and folder: units paired by their name inside each folder (an unpaired one is a difference);
    - folder and file: every file of tensors of the folder against the file;
    - one folder alone (``b=None``): every file of tensors against the first (``rank0.pt`` before ``rank1.pt``).

    ``progress``: called with the bytes of each tensor (or file) read.
    """
    exclude = tuple(exclude)
    pa = Path(a)
    if not pa.exists():
        raise CheckpointError(f"{pa}: no such file or folder")
    if b is None:
        if not pa.is_dir():
            raise CheckpointError(f"{pa}: give two checkpoints, or one folder of per-rank checkpoints")
        units = _tensor_units(pa)
        if len(units) < 2:
            raise CheckpointError(f"{pa}: the folder holds only {units[0].name}; nothing to compare it with")
        return DiffResult([_diff_units(units[0], u, atol, exclude, progress) for u in units[1:]])
    pb = Path(b)
    if not pb.exists():
        raise CheckpointError(f"{pb}: no such file or folder")
    if pa.is_dir() and pb.is_dir():
        ua = {u.name: u for u in folder_units(pa)}
        ub = {u.name: u for u in folder_units(pb)}
        if not any(u.kind != "bytes" for u in (*ua.values(), *ub.values())):
            _tensor_units(pa)  # neither holds a checkpoint: said as such
        pairs = []
        for rel in sorted(set(ua) | set(ub), key=_natural_key):
            if any(fnmatch.fnmatchcase(rel, pat) for pat in exclude):  # a file left out by name (trainer_state.json)
                continue
            if rel in ua and rel in ub:
                pairs.append(_diff_units(ua[rel], ub[rel], atol, exclude, progress, folders=True))
            elif rel in ua:
                pairs.append(PairDiff(str(ua[rel].files[0]), None, note=f"{rel} is missing from {pb}"))
            else:
                pairs.append(PairDiff(None, str(ub[rel].files[0]), note=f"{rel} is only in {pb}"))
        return DiffResult(pairs)
    for p in (pa, pb):
        if not p.is_dir():
            regular_file(p)  # a FIFO or device is refused, never waited on
    file_a, file_b = folder_units(pa)[0] if pa.is_file() else None, folder_units(pb)[0] if pb.is_file() else None
    if file_a is None and file_b is not None:
        return DiffResult([_diff_units(u, file_b, atol, exclude, progress) for u in _tensor_units(pa)])
    if file_b is None and file_a is not None:
        return DiffResult([_diff_units(file_a, u, atol, exclude, progress) for u in _tensor_units(pb)])
    assert file_a is not None and file_b is not None
    return DiffResult([_diff_units(_as_tensors(file_a), _as_tensors(file_b), atol, exclude, progress)])


def _as_tensors(u: Unit) -> Unit:
    """A file named on the command line is read for its tensors whatever its name (refused if it holds none)."""
    return u._replace(kind="tensors")
