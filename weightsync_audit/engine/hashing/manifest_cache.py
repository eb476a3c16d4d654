"""A manifest built once and reused while the audited structure holds: :class:`ManifestCache`.

Building a manifest costs a few microseconds per entry (names, one ``Entry`` per tensor); a model with
Adam's state has four entries per parameter, so on models of many small tensors the build, not the
hashing, was the cost of an audit. The cache keeps what a build found as flat lists (no ``Entry``
objects, no strong reference to any tensor, module or optimizer) and, at each audit, checks that the
structure still holds, with C-level passes over what the module and optimizers hold *now*:

- the module tree: the same module objects, and in each one the same keys and the same objects in
  ``_modules``, ``_parameters`` and ``_buffers`` (a swapped parameter, a re-assigned buffer, an added or
  replaced layer all change this);
- each optimizer: the same ``state`` mapping, the same state dicts with the same keys and objects (the
  first step that creates ``exp_avg`` changes it; so does ``load_state_dict``), the same param groups
  with the same keys and parameters;
- every audited tensor: the same dtype, device, shape and strides, and for those hashed in place the
  same data pointer (``model.half()``, ``.to()``, ``p.data = ...`` and ``p.set_()`` all change these),
  checked by :meth:`DigestPlan.verify` chunk by chunk with the hashing.

The dicts are vouched for by their version tags (PEP 509, :func:`~weightsync_audit.compat.dict_version_reader`):
one C call per dict, and an unchanged tag proves the same keys holding the same objects. Only when a
tag moved are sizes, keys and object ids compared; if they held, the new tags are kept.

A DTensor is vouched for by its mesh, placements, global shape, dtype and trainable flag, and its local
tensor (``_local_tensor``, which FSDP2 re-assigns in place) is then checked like any other; a sharded
manifest's entries are made again from the snapshot at each audit (its peers are found from them).
Anything different, or anything the check cannot vouch for (``grads``, other tensor subclasses, layouts
written by an engine's replica rules, lists or tuples of tensors in optimizer state, such as LBFGS's
histories), means a rebuild
(:func:`~weightsync_audit.engine.inventory.manifest.build_manifest`): never a stale manifest. Values are
never cached: tensors are hashed where they live, Python values (lr, betas, steps) re-read, at every audit.
"""

from __future__ import annotations

import collections
import itertools
import operator
import weakref
from dataclasses import replace
from typing import Any, Callable, Hashable, Sequence

import torch
from torch import nn

from weightsync_audit.compat import dict_version_reader, dtensor_local, is_dtensor
from weightsync_audit.engine.hashing.digest import structure_digest
from weightsync_audit.engine.hashing.digest_plan import DigestPlan, PreparedManifest, StructureSnapshot, placed
from weightsync_audit.engine.inventory.manifest import (
    KINDS,
    Manifest,
    dtype_name,
    holds_tensor,
    unwrap_module,
    value_as_tensor,
)
from weightsync_audit.engine.inventory.peers import shard_info

__all__ = ["ManifestCache", "PreparedManifest"]

_chain = itertools.chain.from_iterable
_MODULES = operator.attrgetter("_modules")
_PARAMETERS = operator.attrgetter("_parameters")
_BUFFERS = operator.attrgetter("_buffers")
_PLAIN = (torch.Tensor, nn.Parameter)
_PLAIN_SET = frozenset(_PLAIN)
_T = torch.Tensor
# The tensor's C getters: map() over them runs without a Python frame per tensor.
_DTYPE = _T.dtype.__get__  # type: ignore[attr-defined]
_NBYTES = _T.nbytes.__get__  # type: ignore[attr-defined]
_SHAPE = _T.shape.__get__  # type: ignore[attr-defined]
_VERSION = dict_version_reader()
_STATE_TYPES = (dict, collections.defaultdict)
_SCALAR_TYPES = frozenset((bool, int, float, str, type(None)))
_NOTHING = torch.zeros(0)  # a kept entry's tensor: the snapshot holds none of the audited ones


def _dicts(mods: Sequence[nn.Module]) -> list[list[dict[str, Any]]]:
    return [list(map(_MODULES, mods)), list(map(_PARAMETERS, mods)), list(map(_BUFFERS, mods))]


def _walk(
    mods: Sequence[nn.Module], versions: list[int] | None = None
) -> tuple[list[Any] | None, list[Any], list[Any], list[int] | None]:
    """The module tree's fingerprint (dict sizes, keys, value ids), its parameter and buffer values, and
    its dicts' version tags (``None`` without tags).

    With ``versions`` (the tags when the fingerprint was taken), the fingerprint is ``None`` when every
    dict still has its tag: nothing in them changed, so there is nothing to compare. Only non-empty
    dicts are iterated: a model of many small layers has mostly empty ``_modules`` and ``_buffers``,
    and what costs here is touching each dict.
    """
    dicts = _dicts(mods)
    now = None if _VERSION is None else list(map(_VERSION, _chain(dicts)))
    if versions is not None and now == versions:
        params, buffers = (list(_chain(map(dict.values, filter(None, d)))) for d in dicts[1:])
        return None, params, buffers, now
    full = [list(filter(None, d)) for d in dicts]
    children, params, buffers = (list(_chain(map(dict.values, f))) for f in full)
    fingerprint = [
        *(list(map(len, d)) for d in dicts),
        *(list(_chain(f)) for f in full),
        list(map(id, children)),
        list(map(id, params)),
        list(map(id, buffers)),
    ]
    return fingerprint, params, buffers, now


def _groups(opt: torch.optim.Optimizer) -> list[Any]:
    # Each group's keys and parameters. Not its dict's version tag: a scheduler re-assigns ``lr`` at every
    # step, which moves the tag without changing the structure (the values are re-read at every audit).
    groups = opt.param_groups
    params = [g["params"] for g in groups]
    return [list(map(len, groups)), list(_chain(groups)), list(map(len, params)), list(map(id, _chain(params)))]


def _optimizer_versions(opt: torch.optim.Optimizer) -> list[Any]:
    # Version tags of the state mapping and of each state dict (equal: the same keys holding the same
    # objects), then the groups.
    assert _VERSION is not None
    return [_VERSION(opt.state), list(map(_VERSION, opt.state.values())), *_groups(opt)]


def _optimizer_fingerprint(opt: torch.optim.Optimizer) -> list[Any]:
    # Which parameters have state, under which keys, and the groups. The state tensors themselves are
    # fetched by position at every audit and checked by layout and address.
    state = opt.state
    dicts = list(state.values())
    return [list(map(id, state)), list(map(len, dicts)), list(_chain(dicts)), *_groups(opt)]


def _plain(mods: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether every container is a plain ``dict`` (``opt.state`` also a ``defaultdict``), the only kind
    whose version tag and ``dict.values`` follow its iteration order: an ``OrderedDict`` can reorder
    (``move_to_end``) without either changing, so a structure holding one is never cached."""
    return all(type(d) is dict for d in _chain(_dicts(mods))) and all(
        type(o.state) in _STATE_TYPES and all(type(s) is dict for s in o.state.values()) for o in optimizers
    )


def _state_values(optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
    return list(_chain(map(dict.values, _chain(opt.state.values() for opt in optimizers))))


def _reread(value: Any) -> tuple[torch.Tensor, str, tuple[int, ...]] | None:
    """A Python value (or a plain tensor) re-read for this audit, encoded as the manifest encodes it."""
    if isinstance(value, torch.Tensor):
        if type(value) not in _PLAIN or value.layout is not torch.strided or value.is_meta:
            return None
        t = value.detach()
        return t, dtype_name(t.dtype), tuple(t.shape)
    if isinstance(value, (list, tuple, dict)) and holds_tensor(value):
        return None  # now audited item by item (an LBFGS history that was empty got its first tensor)
    t, label = value_as_tensor(value)
    return t, label, (tuple(t.shape) if label not in ("none", "object") else ())


def _immutable(value: Any) -> bool:
    """Whether ``value`` can never change in place: a Python scalar, or a tuple of them (Adam's betas)."""
    return type(value) in _SCALAR_TYPES or (type(value) is tuple and all(type(v) in _SCALAR_TYPES for v in value))


def _unless_all(positions: list[int], n: int) -> list[int] | None:
    return None if n and positions == list(range(n)) else positions


def _no_object() -> None:
    return None


def _spec(t: Any) -> tuple[Any, ...]:
    # What a DTensor's entry follows besides its local tensor: its ShardInfo (mesh, placements, global shape), dtype, flag.
    return (type(t), t.device_mesh, t.placements, t.shape, t.dtype, t.requires_grad)


def _local(at: Sequence[int], specs: list[Any] | None, sources: list[Any]) -> list[Any] | None:
    """The specs of the DTensors at ``at`` in ``sources`` (``None`` where they are not ``specs``), each then
    replaced by its local tensor: a source checked like any other."""
    held = [sources[i] for i in at]
    now = list(map(_spec, held))
    if specs is not None and now != specs:
        return None
    for i, t in zip(at, held):
        sources[i] = dtensor_local(t)
    return now


class ManifestCache:
    """Hands out a :class:`PreparedManifest`, rebuilding only when the audited structure changed.

    >>> import torch
    >>> from weightsync_audit.engine.inventory.manifest import build_manifest
    >>> model = torch.nn.Linear(4, 2)
    >>> cache = ManifestCache()
    >>> first = cache.prepare(model, [], key=(), build=lambda: build_manifest(model))
    >>> again = cache.prepare(model, [], key=(), build=lambda: build_manifest(model))
    >>> third = cache.prepare(model, [], key=(), build=lambda: build_manifest(model))
    >>> (first.size, third.size, cache.builds)  # the first use builds; the second builds and keeps it
    (2, 2, 2)
    """

    def __init__(self) -> None:
        self._snaps: dict[Hashable, StructureSnapshot] = {}
        """One structure per kinds audited (an auditor's audits of the weights and of the gradients alternate)."""
        self.builds = 0
        """How many times a manifest was built (for tests and benchmarks)."""
        self._used: set[Hashable] = set()

    def clear(self) -> None:
        """Forget the cached structures: the next :meth:`prepare` builds."""
        self._snaps.clear()

    def prepare(
        self,
        module: nn.Module | None,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        key: Hashable,
        build: Callable[[], Manifest],
        method: str = "auto",
        kinds: Hashable = (),
    ) -> PreparedManifest:
        """The manifest for this audit: the cached one when the structure holds, else ``build()``.

        ``key`` holds every setting the manifest depends on (include, exclude, ...); ``build`` builds
        the manifest of ``module`` and ``optimizers`` with those settings. With any ``method`` but
        ``"device"``, the check that the structure holds also hashes the small tensors as it goes.
        ``kinds``: what is audited (each kept apart, so that audits of different kinds never evict each other).
        """
        hash_in_place = method != "device"
        snap = self._snaps.pop(kinds, None)
        if snap is not None:
            try:
                prepared = _check(snap, module, optimizers, key, build, hash_in_place)
            except Exception:  # noqa: BLE001 - anything odd is a miss: the build reports it properly
                prepared = None
            if prepared is not None:
                self._snaps[kinds] = snap
                return prepared
        self.builds += 1
        manifest = build()
        if kinds not in self._used:  # a one-shot audit (a fresh Auditor) would pay for a snapshot it never uses
            self._used.add(kinds)
            return PreparedManifest.uncached(manifest)
        try:
            snap = _snapshot(module, optimizers, key, manifest)
        except Exception:  # noqa: BLE001 - a structure this cache does not understand is simply not cached
            snap = None
        if snap is None:
            return PreparedManifest.uncached(manifest)
        try:
            prepared = _check(snap, module, optimizers, key, build, hash_in_place)
        except Exception:  # noqa: BLE001
            prepared = None
        if prepared is None:  # the structure moved under the build (it cannot, but never trust a cache)
            return PreparedManifest.uncached(manifest)
        self._snaps[kinds] = snap
        prepared.built = manifest
        return prepared


def _check(
    snap: StructureSnapshot,
    module: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    key: Hashable,
    build: Callable[[], Manifest],
    hash_in_place: bool,
) -> PreparedManifest | None:
    """This audit's prepared manifest when everything ``snap`` recorded still holds, else ``None``."""
    if key != snap.key or snap.root() is not module or len(optimizers) != len(snap.optimizers):
        return None
    if any(r() is not o for r, o in zip(snap.optimizers, optimizers)):
        return None
    if snap.user() is not (unwrap_module(module) if module is not None else None):
        return None
    mods = list(map(weakref.ref.__call__, snap.modules))
    if None in mods:
        return None
    fingerprint, params, buffers, module_versions = _walk(mods, snap.module_versions)  # type: ignore[arg-type]
    if fingerprint is not None and fingerprint != snap.module_fingerprint:
        return None
    optimizer_versions = None if _VERSION is None else list(map(_optimizer_versions, optimizers))
    optimizers_moved = optimizer_versions is None or optimizer_versions != snap.optimizer_versions
    if optimizers_moved and list(map(_optimizer_fingerprint, optimizers)) != snap.optimizer_lists:
        return None
    if (fingerprint is not None or optimizers_moved) and not _plain(mods, optimizers):
        return None  # compared key by key: the tags kept below must be ones that follow the order
    sources: list[Any] = []
    for positions, values in (
        (snap.param_pos, lambda: params),
        (snap.buffer_pos, lambda: buffers),
        (snap.state_pos, lambda: _state_values(optimizers)),
    ):
        if positions is None:  # every value is audited, in order: the list itself is the sources
            sources.extend(values())
        elif positions:
            sources.extend(map(values().__getitem__, positions))
    if snap.dtensors and not _local(snap.dtensors, snap.specs, sources):
        return None
    # The same objects (checked above) with the same dtype, device, shape and strides, and the tensors
    # hashed in place still at the same address: then each cached wrapper covers exactly its tensor.
    in_place = snap.plan.verify(sources, hash_in_place=hash_in_place)
    if in_place is None:
        return None
    # Python values (and param-group tensors) are re-read: their values change, their encoding must not.
    raw = [optimizers[oi].param_groups[gi][k] for oi, gi, k, _, _ in snap.groups]
    if snap.state_values:
        dicts = [list(opt.state.values()) for opt in optimizers]
        raw += [dicts[oi][si][k] for oi, si, k, _, _ in snap.state_values]
    memo = snap.memo
    if not (memo and len(raw) == len(memo[0]) and all(map(operator.is_, raw, memo[0]))):
        values: list[torch.Tensor] = []
        for (*_, label, shape), value in zip(itertools.chain(snap.groups, snap.state_values), raw):
            got = _reread(value)
            if got is None or got[1] != label or got[2] != shape:
                return None
            values.append(got[0])
        # The very same immutable objects next time are the same values: their tensors and digests are kept.
        memo[:] = [raw, values, {}] if all(map(_immutable, raw)) else []
    # The structure held: tags that moved without a change (a key deleted and put back, a Python value
    # in the state re-assigned) are the tags to compare from now on.
    snap.module_versions, snap.optimizer_versions = module_versions, optimizer_versions
    now = memo[1] if memo else values
    if snap.templates:  # a sharded manifest: its entries are made, when asked for, from what this check found
        held = [(list(opt.param_groups), list(opt.state.values())) for opt in optimizers]
        build = lambda: snap.rebuilt(sources, now, held)  # noqa: E731
    return PreparedManifest(
        size=snap.size,
        structure=snap.structure,
        notes=list(snap.notes),
        kind_counts=snap.kind_counts,
        plan=snap.plan,
        build=build,
        sources=sources,
        slow_mask=snap.slow_mask,
        dynamic=now,
        in_place=in_place if hash_in_place else None,
        sharded=bool(snap.templates),
        dynamic_digests=memo[2] if memo else None,
    )


def _snapshot(
    module: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    key: Hashable,
    manifest: Manifest,
) -> StructureSnapshot | None:
    """What :func:`_check` compares against; ``None`` when this manifest cannot be cached."""
    entries = manifest.entries
    if any(e.kind == "grad" or e.note for e in entries):
        return None  # grads come and go every step
    user = unwrap_module(module) if module is not None else None
    named = list(user.named_modules()) if user is not None else []
    mods = [m for _, m in named]
    if not _plain(mods, optimizers):
        return None
    if (found := placed(entries, named, optimizers)) is None:
        return None
    positions, index, groups, state_values, dyn_index, where = found
    fingerprint, params, buffers, module_versions = _walk(mods)
    states = _state_values(optimizers)
    sources = (
        [params[p] for p in positions["param"]]
        + [buffers[p] for p in positions["buffer"]]
        + [states[p] for p in positions["optimizer"]]
    )
    src_index = index["param"] + index["buffer"] + index["optimizer"]
    dtensors = [i for i, s in enumerate(sources) if is_dtensor(s)]
    shards: list[Any] = [None] * len(entries)
    for i in dtensors:
        shards[src_index[i]] = shard_info(sources[i])
    if [e.shard for e in entries] != shards:
        return None  # a layout written by an engine's replica rules: built at every audit
    specs = _local(dtensors, None, sources)
    if not set(map(type, sources)) <= _PLAIN_SET:
        return None
    built = [entries[i].tensor for i in src_index]  # the build and this walk must agree on every tensor
    for prop in (_T.data_ptr, _DTYPE, _NBYTES, _SHAPE):
        if list(map(prop, sources)) != list(map(prop, built)):
            return None
    plan = DigestPlan(size=len(entries), sources=sources, source_index=src_index, dynamic_index=dyn_index)
    slow_mask = [not f for f in plan.fast_mask]
    counts = dict.fromkeys(KINDS, 0)
    for e in entries:
        counts[e.kind] += 1
    return StructureSnapshot(
        key=key,
        root=weakref.ref(module) if module is not None else _no_object,
        user=weakref.ref(user) if user is not None else _no_object,
        modules=[weakref.ref(m) for m in mods],
        module_fingerprint=fingerprint,  # type: ignore[arg-type]
        module_versions=module_versions,
        optimizers=[weakref.ref(o) for o in optimizers],
        optimizer_lists=list(map(_optimizer_fingerprint, optimizers)),
        optimizer_versions=None if _VERSION is None else list(map(_optimizer_versions, optimizers)),
        param_pos=_unless_all(positions["param"], len(params)),
        buffer_pos=_unless_all(positions["buffer"], len(buffers)),
        state_pos=_unless_all(positions["optimizer"], len(states)),
        slow_mask=slow_mask,
        groups=groups,
        state_values=state_values,
        size=len(entries),
        structure=structure_digest(entries),
        notes=list(manifest.notes),
        kind_counts=counts,
        plan=plan,
        dtensors=dtensors,
        specs=specs or [],
        templates=[replace(e, tensor=_NOTHING, container=None) for e in entries] if dtensors else [],
        where=where if dtensors else [],
    )
