"""Two checkpoints compared by their sidecars, loading neither: the digests of their tensors, trusted only
while each file is still the one its sidecar identifies (``files``: size and xxh3 of the bytes at save).

A file changed after its sidecar was written (its bytes edited, the file swapped, the sidecar copied along
to another file) makes the comparison fail, naming the file: its sidecar no longer says what it holds. A
sidecar that cannot tell (written by an earlier version, without ``files``: *unidentified*), a malformed
one, or a ``torch.distributed.checkpoint`` folder's (shard files, not tensors) is no basis for a comparison:
:func:`diff_sidecars` then says why, and the files themselves are compared.

>>> import os, tempfile, torch
>>> from weightsync_audit import Auditor
>>> d = tempfile.mkdtemp()
>>> model = torch.nn.Linear(2, 2)
>>> for name in ("a.pt", "b.pt"):
...     torch.save(model.state_dict(), os.path.join(d, name))
...     _ = Auditor(model).checkpoint_saved(os.path.join(d, name), 1)
>>> compared = diff_sidecars(os.path.join(d, "a.pt"), os.path.join(d, "b.pt"))
>>> compared.rows, compared.stale, compared.why_not
([], [], None)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from weightsync_audit.engine.checkpoints.files import file_changes
from weightsync_audit.engine.checkpoints.sidecar import SidecarError, read_sidecar

__all__ = ["SidecarDiff", "diff_sidecars"]


@dataclass(slots=True)
class SidecarDiff:
    """The outcome of comparing two checkpoints by their sidecars."""

    rows: list[tuple[str, str]] = field(default_factory=list)
    """``(name, missing|extra|values)`` for every tensor whose saved digest differs."""
    count: int = 0
    """How many tensors A's sidecar records."""
    stale: list[str] = field(default_factory=list)
    """``A: m.pt (1200 bytes when saved, 1300 now)``: files no longer as their sidecar identifies them."""
    why_not: str | None = None
    """Why the sidecars are no basis for a comparison (then the files are compared); ``None`` when they are."""

    @property
    def identical(self) -> bool:
        """Every tensor has the same saved digest and every file is still the one its sidecar identifies."""
        return self.why_not is None and not self.rows and not self.stale


def diff_sidecars(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> SidecarDiff | None:
    """Compare A and B by their sidecars; ``None`` when either has none. Each file is checked against its
    sidecar's ``files`` first (its bytes are read, never interpreted)."""
    sides = {}
    for label, path in (("A", a), ("B", b)):
        if not os.path.exists(path):
            return None  # the files are compared: "no such file"
        try:
            sidecar = read_sidecar(path)
        except SidecarError as exc:
            return SidecarDiff(why_not=f"{label}'s sidecar is unusable ({exc})")
        if sidecar is None:
            return None
        if "shards" in sidecar:
            return SidecarDiff(why_not=f"{label} is a torch.distributed.checkpoint folder (its sidecar records shards)")
        if "files" not in sidecar:
            return SidecarDiff(
                why_not=f"{label}'s sidecar does not identify its files (written by an earlier version): unidentified"
            )
        sides[label] = (path, sidecar)
    out = SidecarDiff()
    for label, (path, sidecar) in sides.items():
        now = file_changes(path, sidecar["files"])
        out.stale += [f"{label}: {c}" for c in now.changed] + [f"{label}: {m} is gone" for m in now.missing]
        out.stale += [f"{label}: {m} was added" for m in now.added]
    ta, tb = sides["A"][1]["tensors"], sides["B"][1]["tensors"]
    out.rows = [(n, "missing") for n in sorted(set(ta) - set(tb))] + [(n, "extra") for n in sorted(set(tb) - set(ta))]
    out.rows += [(n, "values") for n in sorted(set(ta) & set(tb)) if ta[n] != tb[n]]
    out.count = len(ta)
    return out
