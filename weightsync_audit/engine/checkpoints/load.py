"""Loading one checkpoint file (for ``diff`` and ``verify``): ``torch.load(weights_only=True)``, never a
file's code, and a plain one-line refusal for a file that is no checkpoint at all (a report, a text, an
image).
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from weightsync_audit.errors import CheckpointError, UnsafeCheckpointError

__all__ = ["CheckpointError", "UnsafeCheckpointError", "load_checkpoint"]


def load_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Load one file with ``weights_only=True`` onto the CPU; refuse anything that needs code.

    Raises :class:`UnsafeCheckpointError` for a file whose unpickling would import or call something
    outside PyTorch's allow-list, and :class:`CheckpointError` for any other unreadable file.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    if p.is_dir():
        raise CheckpointError(f"{p}: is a folder, expected a checkpoint file")
    if not p.is_file():
        raise CheckpointError(f"{p}: not a regular file (a FIFO, socket or device); give a checkpoint file")
    _check_looks_like_a_checkpoint(p)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the refusal below says it all
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
