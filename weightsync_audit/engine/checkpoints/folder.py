"""The one reader of a checkpoint folder: which of its files hold tensors and which are metadata, every
path confined to the folder, and each file's identity (size and xxh3-64 of its bytes) at save time.

:func:`folder_units` is the one rule ``diff``, ``verify``, the resume checks and ``check`` read a folder by:
a ``torch.distributed.checkpoint`` folder (``.metadata`` and ``__<rank>_<n>.distcp``) is one unit read per
tensor; the shards an ``*.index.json`` names (``model-00001-of-00002.safetensors``, sharded ``.bin``) are one
unit; every other file ending in :data:`TENSOR_SUFFIXES` is a unit of tensors, except the metadata
:data:`METADATA_FILES` (Hugging Face's ``training_args.bin``, a pickle of code); the rest (JSON, text,
``.pkl``) is metadata, compared by its bytes. No file is read whose path leaves the folder (a symlink, ``..``):
it is named and refused (:class:`CheckpointError`) before anything is read.

A sidecar's ``files`` names every file a resume reads: the file itself for a single-file checkpoint; for a
folder, every regular file in it (a Hugging Face ``checkpoint-N``: the weights, ``optimizer.pt``,
``scheduler.pt``, ``trainer_state.json``, ``rng_state_{rank}.pth``, ``training_args.bin``, ...; a
``torch.distributed.checkpoint`` folder: ``.metadata`` and every ``__<rank>_<n>.distcp``; a DeepSpeed
``save_checkpoint`` folder: ``latest`` and the tag it names), the sidecar itself aside. Identifying a file
reads its bytes once (xxh3 streams at memory speed) and never interprets them.

>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> _ = open(os.path.join(d, "m.pt"), "wb").write(b"bytes")
>>> path = os.path.join(d, "m.pt")
>>> files = complete_files(path, list_files(path), {})
>>> files["m.pt"]["bytes"], file_changes(path, files)
(5, FileChanges(changed=[], missing=[], added=[]))
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Collection, Mapping, NamedTuple

import xxhash

from weightsync_audit.engine.checkpoints.load import read_json
from weightsync_audit.errors import CheckpointError

__all__ = [
    "METADATA_FILES",
    "SIDECAR_NAME",
    "TENSOR_SUFFIXES",
    "Unit",
    "folder_units",
    "holds_tensors",
    "inside",
    "checkpoint_files",
    "complete_files",
    "FileChanges",
    "dcp_shards",
    "digest_share",
    "file_changes",
    "file_digest",
    "is_dcp_folder",
    "list_files",
]

SIDECAR_NAME = "weightsync.json"
"""The sidecar's name inside a checkpoint folder (never one of the files it describes)."""

DCP_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")

TENSOR_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".tar")
"""The endings of the files that hold tensors (``.pkl`` is a pickle of anything: metadata, compared by bytes)."""

METADATA_FILES = ("training_args.bin",)
"""Files with a tensor ending that hold no tensors (a Trainer's arguments: a pickle that needs code to load)."""


def holds_tensors(name: str) -> bool:
    """Whether the file ``name`` (relative, ``/``-separated) holds tensors: the one rule every command reads.

    >>> holds_tensors("checkpoint-8/model.safetensors"), holds_tensors("training_args.bin")
    (True, False)
    """
    base = name.rsplit("/", 1)[-1]
    return base.lower().endswith(TENSOR_SUFFIXES) and base not in METADATA_FILES


class Unit(NamedTuple):
    """What a folder is compared and verified by: a file of tensors, the shards one index names, a DCP folder,
    or a metadata file (``kind``: ``tensors``, ``dcp`` or ``bytes``)."""

    name: str
    """The relative name both sides are paired by (a sharded set: its index's name without ``.index.json``)."""
    kind: str
    files: tuple[Path, ...]


def inside(folder: str | os.PathLike[str], name: str) -> Path:
    """``folder/name``, refused (:class:`CheckpointError`, nothing read) when it leads outside ``folder``."""
    root = Path(folder)
    f = root / name
    try:
        ok = f.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        ok = False
    if not ok:
        raise CheckpointError(f"{f}: leads outside the checkpoint folder {root} (a symlink or '..'); refused, not read")
    return f


def _is_dcp_file(base: str) -> bool:
    return base == ".metadata" or DCP_FILE.fullmatch(base) is not None


def _index_shards(name: str, f: Path) -> list[str]:
    """The files an ``*.index.json`` names (its ``weight_map``'s values), relative to the checkpoint folder."""
    doc = read_json(f, "checkpoint index")
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    where = name.rpartition("/")[0]
    return sorted({f"{where}/{v}" if where else str(v) for v in (wmap or {}).values() if isinstance(v, str)})


def folder_units(path: str | os.PathLike[str]) -> list[Unit]:
    """The units of the checkpoint at ``path`` (a file: itself), in name order (see the module's docstring)."""
    p = Path(path)
    files = checkpoint_files(p)
    if p.is_file():
        return [Unit(p.name, "tensors" if holds_tensors(p.name) else "bytes", (p,))]
    taken: set[str] = set()
    units = []
    dcp = sorted({n.rpartition("/")[0] for n in files if DCP_FILE.fullmatch(n.rsplit("/", 1)[-1])})
    dcp += [n.rpartition("/")[0] for n in files if n.rsplit("/", 1)[-1] == ".metadata"]
    for d in sorted(set(dcp)):
        mine = [n for n in files if n.rpartition("/")[0] == d and _is_dcp_file(n.rsplit("/", 1)[-1])]
        units.append(Unit(d or ".", "dcp", tuple(files[n] for n in mine)))
        taken.update(mine)
    for n, f in files.items():
        if n.endswith(".index.json") and n not in taken:
            shards = [s for s in _index_shards(n, f) if s in files]
            units.append(Unit(n.removesuffix(".index.json"), "tensors", tuple(files[s] for s in shards)))
            taken.update([n, *shards])
    for n, f in files.items():
        if n not in taken:
            units.append(Unit(n, "tensors" if holds_tensors(n) else "bytes", (f,)))
    return sorted(units)


def file_digest(path: str | os.PathLike[str], block: int = 4 << 20) -> str:
    """xxh3-64 of a file's bytes, as 16 hex digits (read into one reused buffer: no allocation per block)."""
    h = xxhash.xxh3_64()
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return f"{h.intdigest():016x}"


def is_dcp_folder(path: str | os.PathLike[str]) -> bool:
    """A ``torch.distributed.checkpoint`` folder: a ``.metadata`` file or ``__<rank>_<n>.distcp`` shards."""
    p = Path(path)
    return p.is_dir() and ((p / ".metadata").is_file() or any(DCP_FILE.fullmatch(q.name) for q in p.iterdir()))


def dcp_shards(folder: str | os.PathLike[str], rank: int | None = None) -> dict[str, dict[str, Any]]:
    """File -> ``{"rank", "digest", "bytes"}`` for the shard files of a DCP folder (only ``rank``'s if given)."""
    out = {}
    for q in sorted(Path(folder).iterdir()):
        m = DCP_FILE.fullmatch(q.name)
        if m and inside(folder, q.name) and (rank is None or int(m.group(1)) == rank):
            out[q.name] = {"rank": int(m.group(1)), "digest": file_digest(q), "bytes": q.stat().st_size}
    return out


def _is_sidecar(name: str) -> bool:
    return name == SIDECAR_NAME or name.startswith(SIDECAR_NAME + ".tmp") or name.endswith("." + SIDECAR_NAME)


def checkpoint_files(path: str | os.PathLike[str]) -> dict[str, Path]:
    """Relative name (``/``-separated) -> path of every file of the checkpoint at ``path``, in name order: the
    file itself, or a folder's files, its sidecar aside. A folder with a ``latest`` file naming one of its
    subfolders (DeepSpeed's tag) is read with that subfolder only; otherwise with all of them."""
    p = Path(path)
    if p.is_file():
        return {p.name: p}
    if not p.is_dir():
        return {}
    top = sorted(p.iterdir())
    subdirs = [d for d in top if d.is_dir() and not d.is_symlink()]
    latest = p / "latest"
    if latest.is_file():
        try:
            tag = latest.read_text(errors="replace").strip()
        except OSError:
            tag = ""
        if tag and "/" not in tag and (p / tag).is_dir():
            subdirs = [p / tag]
    found = [f for f in top if (f.is_file() or f.is_symlink()) and not _is_sidecar(f.name)]
    for d in subdirs:
        found += sorted(f for f in d.rglob("*") if (f.is_file() or f.is_symlink()) and not _is_sidecar(f.name))
    names = [f.relative_to(p).as_posix() for f in found]
    # every symlink is checked, to a folder too (never followed, but named when it leads outside)
    return {n: f for n in names if (f := inside(p, n)).is_file()}


def list_files(path: str | os.PathLike[str], *, shards: bool = True) -> dict[str, list[int]] | None:
    """Name -> ``[size, mtime_ns]`` of every file of the checkpoint at ``path`` (``shards=False``: a DCP
    folder's shard files aside, which the ranks that wrote them digest); ``None`` when there is no checkpoint
    there (yet)."""
    if not os.path.exists(path):
        return None
    out = {}
    for name, f in checkpoint_files(path).items():
        if shards or not DCP_FILE.fullmatch(name):
            st = f.stat()
            out[name] = [st.st_size, st.st_mtime_ns]
    return out


def _located(path: str | os.PathLike[str], name: str) -> Path:
    p = Path(path)
    return inside(p, name) if p.is_dir() else p


def digest_share(
    path: str | os.PathLike[str], listed: Mapping[str, Any], rank: int, world: int
) -> dict[str, dict[str, Any]]:
    """This rank's share of :func:`list_files`'s files (every ``world``-th from ``rank``), digested: each file
    it sees with the size and modification time listed (the same file, on a shared file system). A file it
    sees otherwise (another machine's local disk) or not at all is left out, for :func:`complete_files`."""
    out = {}
    for i, (name, (size, mtime)) in enumerate(sorted(listed.items())):
        if i % world != rank:
            continue
        f = _located(path, name)
        try:
            st = f.stat()
            if (st.st_size, st.st_mtime_ns) == (size, mtime):
                out[name] = {"bytes": size, "digest": file_digest(f)}
        except OSError:
            continue
    return out


def complete_files(
    path: str | os.PathLike[str], listed: Mapping[str, Any], found: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """The sidecar's ``files``: ``found`` (what the ranks digested, DCP shards included) completed with every
    listed file no rank digested, read here (on the rank that listed them)."""
    files = dict(found)
    for name in listed:
        if name not in files:
            f = _located(path, name)
            files[name] = {"bytes": f.stat().st_size, "digest": file_digest(f)}
    return dict(sorted(files.items()))


def _said(name: str, saved: Mapping[str, Any], size: int) -> str:
    if size != saved["bytes"]:
        return f"{name} ({saved['bytes']} bytes when saved, {size} now)"
    return f"{name} (same size, other bytes)"


class FileChanges(NamedTuple):
    """How the files of a checkpoint differ from those its sidecar identifies (each list in name order)."""

    changed: list[str]
    """Files whose bytes differ, each with how (``m.pt (1200 bytes when saved, 1300 now)``)."""
    missing: list[str]
    """Files that are gone."""
    added: list[str]
    """Files of a checkpoint folder that were not there when it was saved (a resume may read them)."""


def file_changes(path: str | os.PathLike[str], recorded: Mapping[str, Any], skip: Collection[str] = ()) -> FileChanges:
    """The files of ``recorded`` (a sidecar's ``files``) that no longer match, those that are gone, and those a
    folder holds now that it did not then, for the checkpoint at ``path``; ``skip``: recorded files checked
    elsewhere (DCP shards, against ``shards``). A single-file checkpoint is matched whatever its name now (a
    copy renamed along with its sidecar is the same file)."""
    p = Path(path)
    single = p.is_file() and len(recorded) == 1
    changed, missing = [], []
    for name, saved in sorted(recorded.items()):
        if name in skip:
            continue
        f = p if single else inside(p, name)
        if not f.is_file():
            missing.append(name)
            continue
        size = f.stat().st_size
        if size != saved["bytes"] or file_digest(f) != saved["digest"]:
            changed.append(_said(name, saved, size))
    added = sorted(set(checkpoint_files(p)) - set(recorded)) if p.is_dir() else []
    return FileChanges(changed, missing, added)
