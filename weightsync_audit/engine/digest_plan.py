"""Value digests of a cached manifest: small tensors hashed in place by one C-level loop, no per-entry objects;
and :class:`PreparedManifest`, what one audit needs from its manifest.

:func:`~weightsync_audit.engine.digest.digest_tensors` hashes a small contiguous CPU tensor by wrapping
its memory in a fresh ``ctypes`` array (about a microsecond each). A :class:`DigestPlan` makes those
wrappers once, when a manifest is built, and each audit then runs ``map(xxh3_64, wrappers)``: one pass in
C over the entries, creating nothing but the result. The digests are exactly the ones ``digest_tensors``
gives (the same bytes through the same xxh3); everything else (large or non-contiguous tensors, tensors
on an accelerator, ``method="device"``, Python values) goes through ``digest_tensors`` itself.

A wrapper is only a pointer and a length; it keeps nothing alive. It is read only after
:class:`~weightsync_audit.engine.manifest_cache.ManifestCache` has checked, in the same audit, that the
tensor it was made for still lives at that address with that byte size and a contiguous layout, so it
reads exactly that tensor's current bytes (the same guarantee the uncached path gets by reading
``data_ptr()`` just before hashing).
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import xxhash

from weightsync_audit.engine.digest import digest_tensors, structure_digest
from weightsync_audit.engine.manifest import Entry, Manifest
from weightsync_audit.engine.sampling import SMALL
from weightsync_audit.engine.sharded import has_shards

__all__ = ["DigestPlan", "PreparedManifest"]

_xxh = xxhash.xxh3_64_intdigest


def _hashed_in_place(t: torch.Tensor) -> bool:
    """Whether ``digest_tensors`` hashes ``t`` whole from its memory with any method but ``device``."""
    return t.is_cpu and 0 < t.nbytes <= SMALL and t.is_contiguous()


@dataclass(slots=True)
class DigestPlan:
    """How to digest one manifest's entries: which are hashed in place, which go the general way.

    ``sources`` (tensors in entry order ``source_index``) and ``dynamic`` (the tensors of re-read
    values, entry order ``dynamic_index``) are only looked at here, when the plan is made.
    """

    size: int
    sources: Sequence[torch.Tensor]
    source_index: Sequence[int]
    dynamic_index: Sequence[int] = ()
    dynamic: Sequence[torch.Tensor] = ()
    fast_mask: list[bool] = field(default_factory=list)
    fast_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    slow_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    all_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    dyn_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    views: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fast_mask = [_hashed_in_place(t) for t in self.sources]
        index = np.asarray(self.source_index, dtype=np.intp)
        mask = np.asarray(self.fast_mask, dtype=bool)
        self.all_index = index
        self.fast_index = index[mask] if len(index) else index
        self.slow_index = index[~mask] if len(index) else index
        self.dyn_index = np.asarray(self.dynamic_index, dtype=np.intp)
        c_char = ctypes.c_char
        # A memoryview hands its buffer to xxh3 a little faster than the ctypes array under it.
        self.views = [
            memoryview((c_char * t.nbytes).from_address(t.data_ptr()))
            for t in itertools.compress(self.sources, self.fast_mask)
        ]
        # The plan must not keep the tensors alive: a cache that did would pin replaced storage.
        self.sources = ()
        self.dynamic = ()

    @classmethod
    def of_entries(cls, entries: Sequence[Entry]) -> DigestPlan:
        """A plan with no cached wrappers: every entry goes through ``digest_tensors`` (used once)."""
        return cls(size=len(entries), sources=(), source_index=(), dynamic_index=range(len(entries)))

    def digests(
        self,
        *,
        slow: Sequence[torch.Tensor],
        dynamic: Sequence[torch.Tensor],
        everything: Sequence[torch.Tensor] | None = None,
        slice_index: int = 0,
        slices: int = 1,
        method: str = "auto",
    ) -> np.ndarray:
        """Digests of every entry, in manifest order, equal to ``digest_tensors`` over the entries.

        ``slow``: the current tensors of the sources not hashed in place, in source order; ``dynamic``:
        the re-read values' tensors; ``everything``: every source's current tensor (for ``device``).
        """
        out = np.zeros(self.size, dtype=np.int64)
        kw = {"slice_index": slice_index, "slices": slices, "method": method}
        if method == "device":  # one call, so one device-to-host transfer for the whole audit
            assert everything is not None
            index = np.concatenate([self.all_index, self.dyn_index])
            if len(index):
                out[index] = digest_tensors([*everything, *dynamic], **kw)  # type: ignore[arg-type]
            return out
        if self.views:
            out[self.fast_index] = np.fromiter(map(_xxh, self.views), np.uint64, len(self.views)).view(np.int64)
        if len(self.slow_index):
            out[self.slow_index] = digest_tensors(slow, **kw)  # type: ignore[arg-type]
        if len(self.dyn_index):
            out[self.dyn_index] = digest_tensors(dynamic, **kw)  # type: ignore[arg-type]
        return out


@dataclass(slots=True)
class PreparedManifest:
    """What one audit needs from its manifest: sizes, the structure digest, the value digests.

    The full :class:`Manifest` (one ``Entry`` per value) is built only when asked for, which the
    auditor does only on divergence. It holds this audit's tensors; drop it when the audit is over.
    """

    size: int
    structure: int
    notes: list[str]
    kind_counts: dict[str, int]
    plan: DigestPlan
    build: Callable[[], Manifest]
    built: Manifest | None = None
    sources: Sequence[torch.Tensor] = ()
    slow_mask: Sequence[bool] = ()
    dynamic: Sequence[torch.Tensor] = ()
    sharded: bool = False
    """Whether any entry is a DTensor (such manifests are never cached, so only an uncached one is)."""

    @property
    def manifest(self) -> Manifest:
        if self.built is None:
            self.built = self.build()
        return self.built

    def counts(self) -> dict[str, int]:
        return dict(self.kind_counts)

    def digests(self, *, slice_index: int = 0, slices: int = 1, method: str = "auto") -> np.ndarray:
        """Every entry's value digest, in manifest order (the same as ``digest_entries`` gives)."""
        if method == "device":
            everything = [s.detach() for s in self.sources]
            slow: list[torch.Tensor] = []
        else:
            everything = None
            slow = (
                [s.detach() for s in itertools.compress(self.sources, self.slow_mask)]
                if len(self.plan.slow_index)
                else []
            )
        return self.plan.digests(
            slow=slow,
            dynamic=self.dynamic,
            everything=everything,
            slice_index=slice_index,
            slices=slices,
            method=method,
        )

    @classmethod
    def uncached(cls, manifest: Manifest) -> PreparedManifest:
        """A prepared manifest around one that was just built (used once, cached nowhere)."""
        entries = manifest.entries
        return cls(
            size=len(entries),
            structure=structure_digest(entries),
            notes=list(manifest.notes),
            kind_counts=manifest.counts(),
            plan=DigestPlan.of_entries(entries),
            build=lambda: manifest,
            built=manifest,
            dynamic=[e.tensor for e in entries],
            sharded=has_shards(entries),
        )
