"""Value digests of a cached manifest: small tensors hashed in place by one C-level loop, no per-entry objects;
and :class:`PreparedManifest`, what one audit needs from its manifest.

:func:`~weightsync_audit.engine.hashing.digest.digest_tensors` hashes a small contiguous CPU tensor by wrapping
its memory in a fresh buffer (:func:`~weightsync_audit.engine.hashing.reader.in_place`) (about a microsecond each). A :class:`DigestPlan` makes those
wrappers once, when a manifest is built, and each audit then runs ``map(xxh3_64, wrappers)``: one pass in
C over the entries, creating nothing but the result. The digests are exactly the ones ``digest_tensors``
gives (the same bytes through the same xxh3); everything else (large or non-contiguous tensors, tensors
on an accelerator, ``method="device"``, Python values) goes through ``digest_tensors`` itself.

A wrapper is only a pointer and a length; it keeps nothing alive. It is read only by
:meth:`DigestPlan.verify`, right after checking, in the same pass, that the tensor it was made for
still lives at that address with the same dtype, shape and strides (so the same byte size and a
contiguous layout): it reads exactly that tensor's current bytes (the same guarantee the uncached path
gets by reading ``data_ptr()`` just before hashing). The check and the hashing go chunk by chunk, so
the tensors' metadata read by the check is still in the CPU's cache for the next pass.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import numpy as np
import torch
import xxhash

from weightsync_audit.compat import layout_guard
from weightsync_audit.engine.hashing.digest import digest_tensors, structure_digest
from weightsync_audit.engine.hashing.reader import SMALL, in_place, readable, storage_fits
from weightsync_audit.engine.inventory.manifest import Entry, Manifest, has_shards

__all__ = ["DigestPlan", "PreparedManifest", "StructureSnapshot", "placed"]

_xxh = xxhash.xxh3_64_intdigest


def _hashed_in_place(t: torch.Tensor) -> bool:
    """Whether ``digest_tensors`` hashes ``t`` whole from its memory with any method but ``device``.

    Not a lazy conjugate or negative view (its memory holds the unresolved values). A later flip of
    either bit, like one of ``requires_grad``, changes the tensor's dispatch keys, which the layout
    guard compares: the plan is then stale and rebuilt.
    """
    return (
        type(t) in _PLAIN
        and t.is_cpu
        and 0 < t.nbytes <= SMALL
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg())
    )


_T = torch.Tensor
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # what the reader's in_place() reads
_PTR = _T.data_ptr
CHUNK = 512
"""Sources verified and hashed per pass: the tensors' metadata read by one check is still in the CPU's
cache for the next (three passes over 20,000 scattered tensors cost a third more than over chunks)."""


def _layouts(ts: Sequence[torch.Tensor]) -> list[Any]:
    # What the guard compares, without it: the type, the lazy bits and the trainable flag included.
    return [(type(t), t.dtype, t.shape, t.stride(), t.device, t.requires_grad, t.is_conj(), t.is_neg()) for t in ts]


def _python_guard(tensors: Sequence[torch.Tensor]) -> Callable[[Sequence[torch.Tensor]], bool]:
    was = _layouts(tensors)
    return lambda now: _layouts(now) == was


class _Chunk(NamedTuple):
    """One run of sources (``lo:hi``): its layout check (one C++ pass, else compared in Python), which of them
    are hashed in place (``None``: all), their addresses and the wrappers over their memory."""

    lo: int
    hi: int
    holds: Callable[[Sequence[torch.Tensor]], bool]
    mask: list[bool] | None
    ptrs: list[int]
    views: list[Any]


@dataclass(slots=True)
class DigestPlan:
    """How to digest one manifest's entries: which are hashed in place, which go the general way.

    ``sources`` (tensors in entry order ``source_index``) are only looked at here, when the plan is made;
    the re-read values come at entry order ``dynamic_index``.
    """

    size: int
    sources: Sequence[torch.Tensor]
    source_index: Sequence[int]
    dynamic_index: Sequence[int] = ()
    fast_mask: list[bool] = field(default_factory=list)
    fast_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    slow_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    all_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    dyn_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    fast_count: int = 0
    chunks: list[_Chunk] = field(default_factory=list)
    floating: dict[torch.dtype, tuple[list[Any], list[int]]] = field(default_factory=dict)
    """Per floating dtype, the wrappers of the in-place tensors and their entry indices (for a NaN/inf
    check over the same memory, read like the wrappers only right after :meth:`verify`)."""

    def __post_init__(self) -> None:
        sources = list(self.sources)
        self.fast_mask = [_hashed_in_place(t) for t in sources]
        index = np.asarray(self.source_index, dtype=np.intp)
        mask = np.asarray(self.fast_mask, dtype=bool)
        self.all_index = index
        self.fast_index = index[mask] if len(index) else index
        self.slow_index = index[~mask] if len(index) else index
        self.dyn_index = np.asarray(self.dynamic_index, dtype=np.intp)
        self.fast_count = int(mask.sum())
        for lo in range(0, len(sources), CHUNK):
            part, fast = sources[lo : lo + CHUNK], self.fast_mask[lo : lo + CHUNK]
            holds = layout_guard(part) or _python_guard(part)
            inplace = list(itertools.compress(part, fast))
            # The reader's buffer itself, not a memoryview over it: one object less to touch per tensor
            # (4-8% of a cached audit of 20,000 tensors, measured).
            views = list(map(in_place, inplace))
            self.chunks.append(
                _Chunk(lo, lo + len(part), holds, None if all(fast) else fast, list(map(_PTR, inplace)), views)
            )
        views_all = [v for c in self.chunks for v in c.views]
        for t, view, at in zip(itertools.compress(sources, self.fast_mask), views_all, self.fast_index.tolist()):
            if t.dtype.is_floating_point or t.dtype.is_complex:
                views, where = self.floating.setdefault(t.dtype, ([], []))
                views.append(view)
                where.append(at)
        # The plan must not keep the tensors alive: a cache that did would pin replaced storage.
        self.sources = ()

    def verify(self, sources: Sequence[torch.Tensor], *, hash_in_place: bool) -> np.ndarray | None:
        """Check that ``sources`` (the same objects, in order) still match the plan, hashing as it goes.

        ``None`` when any source changed its dtype, device, shape or strides, or any tensor hashed in
        place moved: then the plan is stale. Otherwise the in-place tensors' digests (``fast_index``
        order; empty when ``hash_in_place`` is false), each read only after its address was confirmed.
        """
        out = np.empty(self.fast_count if hash_in_place else 0, dtype=np.uint64)
        at = 0
        for lo, hi, holds, mask, ptrs, views in self.chunks:
            part = sources[lo:hi]
            if not holds(part) or list(map(_PTR, part if mask is None else itertools.compress(part, mask))) != ptrs:
                return None
            if hash_in_place and views:
                out[at : at + len(views)] = np.fromiter(map(_xxh, views), np.uint64, len(views))
                at += len(views)
        return out.view(np.int64)

    @classmethod
    def of_entries(cls, entries: Sequence[Entry]) -> DigestPlan:
        """A plan with no cached wrappers: every entry goes through ``digest_tensors`` (used once)."""
        return cls(size=len(entries), sources=(), source_index=(), dynamic_index=range(len(entries)))

    def digests(
        self,
        *,
        slow: Sequence[torch.Tensor],
        dynamic: Sequence[torch.Tensor] | np.ndarray,
        everything: Sequence[torch.Tensor] | None = None,
        in_place: np.ndarray | None = None,
        slice_index: int = 0,
        slices: int = 1,
        method: str = "auto",
    ) -> np.ndarray:
        """Digests of every entry, in manifest order, equal to ``digest_tensors`` over the entries.

        ``slow``: the current tensors of the sources not hashed in place, in source order; ``dynamic``:
        the re-read values' tensors; ``everything``: every source's current tensor (for ``device``); ``in_place``: what
        :meth:`verify` gave, the digests of the tensors hashed in place.
        """
        out = np.zeros(self.size, dtype=np.int64)
        kw = {"slice_index": slice_index, "slices": slices, "method": method}
        if method == "device":  # one call, so one device-to-host transfer for the whole audit
            assert everything is not None
            index = np.concatenate([self.all_index, self.dyn_index])
            if len(index):
                out[index] = digest_tensors([*everything, *dynamic], **kw)  # type: ignore[arg-type]
            return out
        if self.fast_count:
            assert in_place is not None, "a plan with in-place tensors needs their digests from verify()"
            out[self.fast_index] = in_place
        if len(self.slow_index):
            out[self.slow_index] = digest_tensors(slow, **kw)  # type: ignore[arg-type]
        if len(self.dyn_index):  # digested here, or already (an array: their digests)
            out[self.dyn_index] = dynamic if isinstance(dynamic, np.ndarray) else digest_tensors(dynamic, **kw)  # type: ignore[arg-type]
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
    in_place: np.ndarray | None = None
    """The digests of the tensors hashed in place, when the cache's check computed them as it went."""
    sharded: bool = False
    """Whether any entry is a DTensor (then ``build`` makes its entries, which its peers are found from)."""
    dynamic_digests: dict[Any, np.ndarray] | None = None
    """The re-read values' digests by sampling and method, kept while the values are the same objects."""

    @property
    def manifest(self) -> Manifest:
        if self.built is None:
            self.built = self.build()
        return self.built

    def counts(self) -> dict[str, int]:
        return dict(self.kind_counts)

    def digests(self, *, slice_index: int = 0, slices: int = 1, method: str = "auto") -> np.ndarray:
        """Every entry's value digest, in manifest order (the same as ``digest_entries`` gives)."""
        if len(self.plan.slow_index) and not all(map(storage_fits, itertools.compress(self.sources, self.slow_mask))):
            # A storage freed under a tensor the plan does not read in place: the build names it, refusing it.
            self.build()
            raise RuntimeError("an audited tensor's storage no longer holds its view")
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
            if self.plan.fast_count and self.in_place is None:  # prepared for method="device"
                self.in_place = self.plan.verify(self.sources, hash_in_place=True)
                if self.in_place is None:
                    raise RuntimeError("the audited tensors changed between preparing and digesting the audit")
        known = self.dynamic_digests
        if known is not None and method != "device" and len(self.plan.dyn_index):
            key = (slice_index, slices, method)
            if key not in known:
                known[key] = digest_tensors(self.dynamic, slice_index=slice_index, slices=slices, method=method)
            dynamic: Sequence[torch.Tensor] | np.ndarray = known[key]
        else:
            dynamic = self.dynamic
        return self.plan.digests(
            slow=slow,
            dynamic=dynamic,
            everything=everything,
            in_place=self.in_place,
            slice_index=slice_index,
            slices=slices,
            method=method,
        )

    def keep_values(self, launch: PreparedManifest) -> None:
        """Digest the Python values (learning rates, counts kept as numbers) as ``launch`` read them, the
        tensors as they are now: an overlapped audit of step s audited again at rest reads its tensors again,
        and the values step s left, not those set for step s+1 since (by a pre-step hook, which a closure
        optimizer runs before the safe point, or by the loop). Nothing changes where the structures differ."""
        if launch.structure != self.structure or launch.size != self.size:
            return
        if launch.plan is self.plan:  # one cached structure: the values re-read at launch, place by place
            self.dynamic, self.dynamic_digests = launch.dynamic, launch.dynamic_digests
            return
        if launch.built is None:  # no entries of the launch's own to say which places hold a Python value
            return
        then = dict(zip(launch.plan.dyn_index.tolist(), launch.dynamic))
        entries = launch.built.entries
        self.dynamic = [
            then.get(i, t) if entries[i].container is not None else t
            for i, t in zip(self.plan.dyn_index.tolist(), self.dynamic)
        ]
        self.dynamic_digests = None

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


def placed(entries: Sequence[Entry], named: Sequence[tuple[str, torch.nn.Module]], optimizers: Sequence[Any]) -> Any:
    """Per kind, each tensor's place in its chain and manifest (chain order), the values re-read, and where each
    entry's container is found again (``(optimizer, 0, group)``, ``(optimizer, 1, state dict)``, ``None``); or None."""
    at: dict[str, dict[str, int]] = {"_parameters": {}, "_buffers": {}}  # in the chain of module dict values
    for attr, names in at.items():
        pos, seen = 0, set()
        for prefix, mod in named:
            for k, v in getattr(mod, attr).items():
                if v is not None and id(v) not in seen:  # the first name wins, as in the build
                    seen.add(id(v))
                    names[f"{prefix}.{k}" if prefix else k] = pos
                pos += 1
    state_at: dict[tuple[int, Any], int] = {}  # in the chain of state values; each state dict's, group's place
    dict_at: dict[int, tuple[int, int]] = {}
    group_at: dict[int, tuple[int, int]] = {}
    pos = 0
    for oi, opt in enumerate(optimizers):
        for si, state in enumerate(opt.state.values()):
            dict_at[id(state)] = (oi, si)
            for k in state:
                state_at[(id(state), k)] = pos
                pos += 1
        group_at.update((id(group), (oi, gi)) for gi, group in enumerate(opt.param_groups))
    positions: dict[str, list[int]] = {"param": [], "buffer": [], "optimizer": []}
    index: dict[str, list[int]] = {"param": [], "buffer": [], "optimizer": []}
    groups, state_values, group_index, state_index, where = [], [], [], [], []
    for i, e in enumerate(entries):
        c = id(e.container)
        where.append((g[0], 0, g[1]) if (g := group_at.get(c)) else (s[0], 1, s[1]) if (s := dict_at.get(c)) else None)
        if e.kind == "param":
            positions["param"].append(at["_parameters"][e.name])
        elif e.kind == "buffer":
            positions["buffer"].append(at["_buffers"][e.name])
        elif c in group_at:
            groups.append((*group_at[c], e.key, e.dtype, e.shape))
            group_index.append(i)
            continue
        elif c in dict_at and isinstance(e.container.get(e.key), torch.Tensor):
            positions["optimizer"].append(state_at[(c, e.key)])
        elif c in dict_at:
            state_values.append((*dict_at[c], e.key, e.dtype, e.shape))
            state_index.append(i)
            continue
        else:
            return None
        index[e.kind].append(i)
    for kind in positions:  # sources in the order of their chain: most often the chain is the sources
        pairs = sorted(zip(positions[kind], index[kind]))
        positions[kind], index[kind] = [p for p, _ in pairs], [i for _, i in pairs]
    return positions, index, groups, state_values, group_index + state_index, where  # as _check re-reads


@dataclass(slots=True)
class StructureSnapshot:
    """The structure one build found, as flat lists of ints and strings (no strong references): what
    :class:`~weightsync_audit.engine.hashing.manifest_cache.ManifestCache` compares at the next audit."""

    key: Hashable
    root: Callable[[], Any]
    user: Callable[[], Any]
    modules: list[weakref.ref]
    module_fingerprint: list[Any]
    module_versions: list[int] | None  # every module dict's version tag: equal means nothing in them changed
    optimizers: list[weakref.ref]
    optimizer_lists: list[list[Any]]
    optimizer_versions: list[list[Any]] | None
    # For each source, its index in the chain of every module's _parameters (_buffers) values, or of every
    # optimizer's state values; None when that chain, in order, is exactly the sources.
    param_pos: list[int] | None
    buffer_pos: list[int] | None
    state_pos: list[int] | None
    slow_mask: list[bool]
    groups: list[tuple[int, int, Any, str, tuple[int, ...]]]  # re-read: (optimizer, group, key, label, shape)
    state_values: list[tuple[int, int, Any, str, tuple[int, ...]]]  # (optimizer, state dict, key, ...)
    size: int
    structure: int
    notes: list[str]
    kind_counts: dict[str, int]
    plan: DigestPlan
    memo: list[Any] = field(default_factory=list)
    """The last re-read Python values, their tensors and their digests, while those are immutable objects."""
    dtensors: list[int] = field(default_factory=list)  # the sources that are DTensors, their specs (see _check)
    specs: list[Any] = field(default_factory=list)
    templates: list[Entry] = field(default_factory=list)  # a sharded manifest's entries, holding no tensor
    where: list[Any] = field(default_factory=list)  # and where their containers are found again

    def rebuilt(self, sources: Sequence[torch.Tensor], values: Sequence[Any], held: Sequence[Any]) -> Manifest:
        """A sharded manifest's entries as a build makes them: the kept names, kinds and shards with this audit's
        tensors (``sources``, the re-read ``values``) and containers (``held``: each optimizer's param groups
        and state dicts, as the check found them)."""
        tensors: list[Any] = [None] * self.size
        for at, t in zip(self.plan.all_index.tolist(), sources):
            tensors[at] = readable(t)
        for at, t in zip(self.plan.dyn_index.tolist(), values):
            tensors[at] = t
        found = [w and held[w[0]][w[1]][w[2]] for w in self.where]
        entries = [replace(e, tensor=t, container=c) for e, t, c in zip(self.templates, tensors, found)]
        return Manifest(entries, list(self.notes))
