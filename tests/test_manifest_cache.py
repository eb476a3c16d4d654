"""A cached manifest is never stale: after any structure change the next audit sees exactly what a fresh
build sees (names, kinds, dtypes, shapes, digests), values are re-read at every audit, and the cache keeps
no tensor alive."""

from __future__ import annotations

import collections
import copy
import gc
import weakref
from typing import Any, Callable

import numpy as np
import pytest
import torch
from dtypes import ALL_DTYPES
from ranks import run_ranks
from torch import nn

from weightsync_audit import Auditor
from weightsync_audit.engine.hashing import digest_plan, manifest_cache
from weightsync_audit.engine.hashing.digest import digest_entries, structure_digest
from weightsync_audit.engine.hashing.manifest_cache import ManifestCache
from weightsync_audit.engine.inventory.manifest import build_manifest


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
        self.big = nn.Parameter(torch.randn(130, 130))  # over 64 KiB: hashed through the general path
        self.register_buffer("strided", torch.arange(24.0).reshape(4, 6).t())  # non-contiguous
        self.register_buffer("empty", torch.zeros(0))
        for i, dtype in enumerate(ALL_DTYPES):
            self.register_buffer(f"d{i}", torch.ones(3, 5, dtype=dtype))


def adam_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 0.01)
    opt.step()
    for p in model.parameters():
        p.grad = None


def stepped() -> tuple[Net, torch.optim.Adam]:
    """A fresh ``Net`` and its Adam after one step (the optimizer state exists)."""
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    adam_step(model, opt)
    return model, opt


def kept(model: Net, opt: torch.optim.Optimizer) -> Auditor:
    """An ``Auditor`` of ``model`` after two audits: the second keeps the manifest cached."""
    auditor = Auditor(model, opt)
    auditor.audit()
    auditor.audit()
    return auditor


class Oracle:
    """Runs the cache as the auditor does and compares every answer with a fresh build."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer | None, **build_kw: Any) -> None:
        self.model, self.opt, self.build_kw = model, opt, build_kw
        self.cache = ManifestCache()

    def check(self, **kw: Any) -> np.ndarray:
        opts = [self.opt] if self.opt is not None else []

        def build():
            return build_manifest(self.model, opts, **self.build_kw)

        prepared = self.cache.prepare(self.model, opts, key=(), build=build, method=kw.get("method", "auto"))
        fresh = build()
        assert prepared.structure == structure_digest(fresh.entries)
        assert prepared.size == len(fresh.entries)
        assert prepared.counts() == fresh.counts()
        got = prepared.digests(**kw)
        assert np.array_equal(got, digest_entries(fresh.entries, **kw))
        if prepared.sharded:  # its entries (peers, containers, tensors) are made again: as a build makes them
            assert list(map(_entry_view, prepared.manifest.entries)) == list(map(_entry_view, fresh.entries))
        return got


def _entry_view(e: Any) -> tuple:
    t = e.tensor
    return (e.name, e.kind, e.dtype, e.shape, e.shard, e.frozen, e.key, id(e.container), t.data_ptr(), t.shape, t.dtype)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"method": "xxh3"},
        {"method": "device"},
        {"slices": 4, "slice_index": 0},
        {"slices": 4, "slice_index": 3},
        {"slices": 4, "slice_index": 1, "method": "device"},
    ],
)
def test_cached_digests_equal_a_fresh_builds_for_every_dtype_method_and_slice(kw: dict) -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    oracle = Oracle(model, opt)
    for _ in range(3):
        oracle.check(**kw)
    adam_step(model, opt)
    for _ in range(3):
        oracle.check(**kw)
    assert oracle.cache.builds == 3  # used once (not kept), kept at the second build, rebuilt after the step


def _swap_param(m: Net, o: Any) -> None:
    m.a.weight = nn.Parameter(m.a.weight.detach().clone() + 1)


def _new_storage(m: Net, o: Any) -> None:
    m.a.weight.data = m.a.weight.data.clone()


def _set_storage(m: Net, o: Any) -> None:
    with torch.no_grad():
        m.a.weight.set_(m.a.weight.detach().clone())  # the same object, values and layout; another address


def _transpose_in_place(m: Net, o: Any) -> None:
    m.a.weight.data = m.a.weight.data.t()  # same address, same shape, other logical order


def _reshape_same_bytes(m: Net, o: Any) -> None:
    m.a.weight.data = m.a.weight.data.view(4, 16)  # same address, same bytes, another shape


def _half(m: Net, o: Any) -> None:
    m.b.half()


def _requires_grad(m: Net, o: Any) -> None:
    m.a.bias.requires_grad_(False)


def _reassign_buffer(m: Net, o: Any) -> None:
    m.b[1].running_mean = torch.full((4,), 3.0)


def _add_layer(m: Net, o: Any) -> None:
    m.c = nn.Linear(2, 2)


def _tie(m: Net, o: Any) -> None:
    m.b[1].weight = m.b[1].bias


def _lr(m: Net, o: torch.optim.Optimizer) -> None:
    o.param_groups[0]["lr"] = 0.5


def _betas(m: Net, o: torch.optim.Optimizer) -> None:
    o.param_groups[0]["betas"] = (0.8, 0.9)


def _lr_tensor(m: Net, o: torch.optim.Optimizer) -> None:
    o.param_groups[0]["lr"] = torch.tensor(0.25)


def _step_value(m: Net, o: torch.optim.Optimizer) -> None:
    adam_step(m, o)  # values change in place, Adam's 0-d ``step`` included


def _load_state(m: Net, o: torch.optim.Optimizer) -> None:
    o.load_state_dict(copy.deepcopy(o.state_dict()))  # new state tensors, equal values


def _python_state(m: Net, o: torch.optim.Optimizer) -> None:
    o.state[m.a.weight]["count"] = 7


def _python_state_value(m: Net, o: torch.optim.Optimizer) -> None:
    o.state[m.a.bias]["count"] += 1  # set up as 7 before the first audit


def _drop_state(m: Net, o: torch.optim.Optimizer) -> None:
    del o.state[m.a.weight]


def _replace_state_tensor(m: Net, o: torch.optim.Optimizer) -> None:
    st = o.state[m.a.weight]
    st["exp_avg"] = st["exp_avg"].clone() + 1


def _add_group(m: Net, o: torch.optim.Optimizer) -> None:
    extra = nn.Parameter(torch.ones(3))
    m.extra = extra
    o.add_param_group({"params": [extra], "lr": 0.1})


def _flip_bit(m: Net, o: Any) -> None:
    m.a.bias.data.view(torch.int32)[2] ^= 1 << 7


CHANGES: dict[str, Callable[[Net, Any], None]] = {
    "swap a parameter": _swap_param,
    "give a parameter new storage": _new_storage,
    "set_ a parameter to another storage": _set_storage,
    "transpose a parameter in place": _transpose_in_place,
    "reshape a parameter over the same bytes": _reshape_same_bytes,
    "model.half() on a submodule": _half,
    "change requires_grad": _requires_grad,
    "re-assign a buffer": _reassign_buffer,
    "add a layer": _add_layer,
    "tie two parameters": _tie,
    "change a param group's lr": _lr,
    "change a param group's betas": _betas,
    "make lr a tensor": _lr_tensor,
    "take an optimizer step": _step_value,
    "load the optimizer's state dict": _load_state,
    "add a Python value to a parameter's state": _python_state,
    "change a Python value in the state": _python_state_value,
    "drop a parameter's state": _drop_state,
    "replace a state tensor": _replace_state_tensor,
    "add a param group": _add_group,
    "flip one bit of a parameter": _flip_bit,
}


@pytest.mark.parametrize("checks", ["C++ layout guard, dict version tags", "Python layout check", "no version tags"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_the_next_audit_sees_every_change(change: str, checks: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if checks == "Python layout check":  # what runs where torch lacks the compiler's tensor guards
        monkeypatch.setattr(digest_plan, "layout_guard", lambda tensors: None)
    if checks == "no version tags":  # what runs where CPython or torch serves no dict version tags
        monkeypatch.setattr(manifest_cache, "_VERSION", None)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    adam_step(model, opt)  # the first step creates exp_avg, exp_avg_sq and step: a structure change
    opt.state[model.a.bias]["count"] = 7
    oracle = Oracle(model, opt)
    before = oracle.check()
    oracle.check()
    builds = oracle.cache.builds
    CHANGES[change](model, opt)
    after = oracle.check()  # equal to a fresh build's names, kinds, dtypes, shapes and digests
    oracle.check()
    if change in VALUES_ONLY:
        assert oracle.cache.builds == builds, "a change of values only must not rebuild the manifest"
        assert not np.array_equal(before, after)
    elif change not in ("change requires_grad",):
        assert oracle.cache.builds > builds


#: Changes of values only: re-read from the cached structure, no rebuild.
VALUES_ONLY = {
    "change a param group's lr",
    "change a param group's betas",
    "take an optimizer step",
    "change a Python value in the state",
    "flip one bit of a parameter",
}


def test_an_unchanged_structure_is_vouched_for_by_version_tags(monkeypatch: pytest.MonkeyPatch) -> None:
    # With version tags, an audit of an unchanged model (values changed by steps and a scheduler) compares
    # no state keys or ids; without them, the fingerprint is compared every time. Both see a change.
    compared = []
    fingerprint = manifest_cache._optimizer_fingerprint
    monkeypatch.setattr(manifest_cache, "_optimizer_fingerprint", lambda opt: compared.append(1) or fingerprint(opt))
    for tags in (manifest_cache._VERSION, None):
        monkeypatch.setattr(manifest_cache, "_VERSION", tags)
        model, opt = stepped()
        opt.state[model.a.bias]["count"] = 7
        oracle = Oracle(model, opt)
        oracle.check()
        oracle.check()  # builds and keeps the snapshot
        compared.clear()
        for _ in range(3):
            adam_step(model, opt)
            opt.param_groups[0]["lr"] *= 0.9  # a scheduler's step: a value, re-read, not a structure change
            oracle.check()
        assert len(compared) == (0 if tags is not None else 3), tags
        builds = oracle.cache.builds
        opt.state[model.a.bias]["count"] = 8  # a Python value re-assigned: its dict's tag moves, once
        oracle.check()
        oracle.check()
        assert len(compared) == (1 if tags is not None else 5) and oracle.cache.builds == builds
        opt.state[model.a.weight]["exp_avg"] = torch.zeros_like(model.a.weight)
        oracle.check()
        assert oracle.cache.builds == builds + 1


def test_a_manifest_prepared_for_the_device_method_digests_in_place_only_where_nothing_moved() -> None:
    model, opt = stepped()
    cache = ManifestCache()
    for _ in range(3):
        prepared = cache.prepare(model, [opt], key=(), build=lambda: build_manifest(model, [opt]), method="device")
    assert prepared.in_place is None and prepared.plan.fast_count > 0
    assert np.array_equal(prepared.digests(), digest_entries(build_manifest(model, [opt]).entries))
    prepared = cache.prepare(model, [opt], key=(), build=lambda: build_manifest(model, [opt]), method="device")
    with torch.no_grad():
        model.a.weight.set_(model.a.weight.detach().clone())  # moves between the prepare and the digest
    with pytest.raises(RuntimeError, match="changed between preparing and digesting"):
        prepared.digests()


@pytest.mark.parametrize(
    "build_kw",
    [{"exclude": ("b.*", "*.exp_avg_sq")}, {"include": ("params",)}, {"include": ("optimizer",)}],
    ids=["exclude", "params only", "optimizer only"],
)
def test_a_partial_manifest_is_cached_exactly(build_kw: dict) -> None:
    model, opt = stepped()
    oracle = Oracle(model, opt, **build_kw)
    for change in (_step_value, _flip_bit, _half):
        oracle.check()
        oracle.check()
        change(model, opt)
        oracle.check()
    assert oracle.cache.builds == 3  # first use, kept, after half()


class Chunks(nn.Module):
    """Over 1,500 audited tensors, so three chunks of the plan, with large tensors among the small ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(700))
        self.big = nn.Parameter(torch.randn(130, 130))  # hashed through the general path, mid-plan
        self.tail = nn.ModuleList(nn.Linear(4, 4) for _ in range(100))


@pytest.mark.parametrize("where", ["first chunk", "middle chunk", "last chunk", "optimizer state", "large tensor"])
@pytest.mark.parametrize("how", ["set_ to another storage", "flip one bit", "transpose over the same bytes"])
def test_a_change_in_any_chunk_is_seen(where: str, how: str) -> None:
    model = Chunks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adam_step(model, opt)  # SGD's first step creates the momentum buffers
    with torch.no_grad():
        for state in opt.state.values():
            state["momentum_buffer"].uniform_()  # in place: values, not structure
    oracle = Oracle(model, opt)
    before = oracle.check()
    oracle.check()
    assert len(oracle.cache._snaps.get(()).plan.chunks) >= 3  # type: ignore[union-attr]
    t = {
        "first chunk": model.layers[0].weight,
        "middle chunk": model.layers[400].weight,
        "last chunk": opt.state[model.tail[99].weight]["momentum_buffer"],
        "optimizer state": opt.state[model.layers[5].weight]["momentum_buffer"],
        "large tensor": model.big,
    }[where]
    with torch.no_grad():
        if how == "set_ to another storage":
            t.set_(t.detach().clone())
        elif how == "flip one bit":
            t.view(-1).view(torch.int32)[3] ^= 1
        else:
            t.set_(t.detach().t())
    after = oracle.check()  # equal to a fresh build's structure and digests, whatever the change
    assert not np.array_equal(before, after) or how == "set_ to another storage"


def test_an_ordered_dict_container_is_never_cached_so_a_reorder_is_seen() -> None:
    # OrderedDict.move_to_end reorders without changing the dict's version tag or dict.values' order:
    # a structure holding one is rebuilt at every audit, and one swapped in later ends the caching.
    model, opt = stepped()
    model.b[0]._parameters = collections.OrderedDict(model.b[0]._parameters)
    oracle = Oracle(model, opt)
    for _ in range(3):
        oracle.check()
    assert oracle.cache.builds == 3 and oracle.cache._snaps.get(()) is None
    model.b[0]._parameters.move_to_end("weight")
    oracle.check()  # equal to a fresh build: bias now comes before weight
    model.b[0]._parameters = dict(model.b[0]._parameters)
    oracle.check()
    oracle.check()
    assert oracle.cache._snaps.get(()) is not None
    builds = oracle.cache.builds
    opt.state[model.a.weight] = collections.OrderedDict(opt.state[model.a.weight])  # same keys and tensors
    oracle.check()
    assert oracle.cache.builds == builds + 1 and oracle.cache._snaps.get(()) is None


def test_values_are_re_read_without_a_rebuild() -> None:
    model, opt = stepped()
    auditor = kept(model, opt)
    builds = auditor._manifests.builds
    for lr in (0.1, 0.2):
        opt.param_groups[0]["lr"] = lr
        adam_step(model, opt)
        with torch.no_grad():
            model.a.weight.add_(1)
        assert auditor.audit().in_sync
    assert auditor._manifests.builds == builds


def test_the_cache_keeps_no_replaced_tensor_alive() -> None:
    model, opt = stepped()
    auditor = kept(model, opt)  # noqa: F841 - alive to the end: its cache is what must hold no old tensor
    old_state = weakref.ref(opt.state[model.a.weight]["exp_avg"])
    old_weight = model.a.weight.data
    old_storage = weakref.ref(old_weight)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    model.a.weight.data = model.a.weight.data.clone()
    del old_weight
    gc.collect()
    assert old_state() is None and old_storage() is None  # before any further audit


def _diverge_after_cached_audits(rank: int, world: int, how: str) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(50)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    adam_step(model, opt)
    auditor = Auditor(model, opt)
    results = [auditor.audit(step=0).to_dict()]
    results.append(auditor.audit(step=1).to_dict())
    if rank == 1:
        if how == "value":
            with torch.no_grad():
                model[7].bias[1] += 1e-3
        elif how == "state":
            opt.state[model[3].weight]["exp_avg"][0, 0] += 1
        elif how == "dtype":
            model[5].half()
        elif how == "lr":
            opt.param_groups[0]["lr"] = 0.5
    results.append(auditor.audit(step=2).to_dict())
    return results


@pytest.mark.parametrize(
    "how, name, kind",
    [
        ("value", "7.bias", "param"),
        ("state", "3.weight.exp_avg", "optimizer"),
        ("dtype", "5.weight", "structure"),
        ("lr", "param_groups.0.lr", "optimizer"),
    ],
)
def test_two_ranks_find_a_divergence_after_cached_audits(how: str, name: str, kind: str) -> None:
    results = run_ranks(_diverge_after_cached_audits, 2, how)
    for per_rank in results:
        assert per_rank[0]["in_sync"] and per_rank[1]["in_sync"]
        last = per_rank[2]
        assert not last["in_sync"]
        found = {(m["name"], m["kind"]) for m in last["mismatches"]}
        assert (name, kind) in found, found
        assert all(m["ranks"] == [1] for m in last["mismatches"])


def test_audits_of_different_kinds_alternating_on_one_cache_never_evict_each_other() -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adam_step(model, opt)
    cache = ManifestCache()
    kinds = {"weights": ("params", "buffers"), "optimizer": ("optimizer",)}
    for _ in range(4):  # the run's audits after each step and another kind beside them, in turn
        for label, include in kinds.items():
            cache.prepare(
                model, [opt], key=include, build=lambda i=include: build_manifest(model, [opt], include=i), kinds=label
            )
    assert cache.builds == 4  # each kind: its first use, then the build it keeps; never again


def _sharded_cache(rank: int, world: int) -> dict[str, Any]:
    from mesh_models import hsdp_model, train

    model, _ = hsdp_model()  # (replicate=2, shard=2): rank r's shard has its replica on rank r ^ 2
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 1, seed=0)
    oracle = Oracle(model, opt)
    for _ in range(3):
        oracle.check()
    builds = [oracle.cache.builds]
    train(model, opt, 2, seed=1)  # FSDP2 swaps each parameter out and back: values change, the structure holds
    before = oracle.check()
    builds.append(oracle.cache.builds)
    w = model.fc1.weight
    w._local_tensor = w._local_tensor.clone() + 1  # FSDP2's reset_sharded_param: new storage, same layout
    moved = not np.array_equal(before, oracle.check())  # the new storage's values, as a fresh build reads them
    w.requires_grad_(False)  # a DTensor's own flag (its local tensor's is unchanged): the structure moved
    oracle.check()
    builds.append(oracle.cache.builds)
    w.requires_grad_(True)
    auditor = Auditor(model, opt)
    in_sync = [auditor.audit(step=s).in_sync for s in range(3)]
    if rank == 3:
        with torch.no_grad():
            model.fc2.weight._local_tensor[0, 0] += 1e-3  # found from the cached manifest's entries
    found = [(m.name, m.ranks, m.reference_ranks, m.shard) for m in auditor.audit(step=3).mismatches]
    return {"builds": builds, "moved": moved, "sync": in_sync, "found": found, "audits": auditor._manifests.builds}


def test_a_sharded_manifest_is_cached_and_sees_a_new_local_tensor_a_flag_and_a_diverged_shard() -> None:
    for out in run_ranks(_sharded_cache, 4, timeout=180):
        assert out["builds"] == [2, 2, 4] and out["moved"], out
        assert out["sync"] == [True, True, True] and out["audits"] == 2, out
        assert out["found"] == [("fc2.weight", [3], [1], {"shard": 1})], out
