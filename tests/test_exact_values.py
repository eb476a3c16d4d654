"""Every value is compared by its exact bytes (issue 21, items 1, 2, 12, 16): tensors inside optimizer lists
and tuples, lazy conjugate / negative views, a freed storage refused by name (never read), and the
trainable flag as part of the structure, on the first audit and on the cached path alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ranks import run_ranks
from torch import nn

from weightsync_audit import Auditor, UnauditableTensorError, audit
from weightsync_audit.engine.hashing.digest import digest_tensor, digest_tensors
from weightsync_audit.engine.inventory.manifest import build_manifest


def _lbfgs(rank: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=2, history_size=4)
    for _ in range(steps):

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(torch.ones(4, 3)).pow(2).sum()
            loss.backward()
            return loss

        opt.step(closure)
    return model, opt


def _lbfgs_history_differs(rank: int, world: int) -> list[Any]:
    model, opt = _lbfgs(rank, steps=2)
    auditor = Auditor(model, opt, timeout_s=30)
    out = []
    state = opt.state[next(iter(opt.state))]
    assert isinstance(state["old_dirs"], list) and state["old_dirs"]
    # Warm the cache (two audits), then change one element of one history tensor on rank 1 only: the
    # parameters and every other value stay equal, the tensor's repr() does not change at 4 decimals.
    out.append(auditor.audit().in_sync)
    out.append(auditor.audit().in_sync)
    if rank == 1:
        state["old_dirs"][0].view(-1)[0] += 1e-6
    r = auditor.audit()
    out.append(sorted(m.name for m in r.mismatches))
    # The histories grow on a further step: the audit sees the new length (a rebuild) on every rank.
    opt.step(lambda: model(torch.ones(4, 3)).pow(2).sum().backward() or model(torch.ones(4, 3)).pow(2).sum())
    r = auditor.audit()
    out.append(r.checked["optimizer"])
    return out


def test_lbfgs_histories_that_differ_in_one_element_are_found_and_named_by_path() -> None:
    r0, r1 = run_ranks(_lbfgs_history_differs, 2, timeout=120)
    assert r0 == r1
    assert r0[0] is True and r0[1] is True
    assert r0[2] == ["weight.old_dirs.0"]


def test_lbfgs_lists_of_tensors_become_entries_named_by_path_and_python_floats_exact_bits() -> None:
    model, opt = _lbfgs(0, steps=2)
    names = {e.name: e for e in build_manifest(model, [opt]).entries}
    assert "weight.old_dirs.0" in names and names["weight.old_dirs.0"].dtype == "float32"
    assert "weight.ro.0" in names and "weight.al.0" in names
    assert "weight.old_dirs" not in names  # never a repr of the list
    assert names["weight.prev_loss"].dtype == "float64"  # a Python float by its float64 bits


def _betas_differ(rank: int, world: int) -> list[Any]:
    model = nn.Linear(2, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    beta2 = 0.999 if rank == 0 else 0.99902  # equal when printed to 4 decimals
    opt = torch.optim.Adam(model.parameters(), betas=(torch.tensor(0.9), torch.tensor(beta2)))
    auditor = Auditor(model, opt, timeout_s=30)
    first = auditor.audit()
    second = auditor.audit()
    return [sorted(m.name for m in first.mismatches), sorted(m.name for m in second.mismatches)]


def test_tensor_betas_that_round_alike_are_a_mismatch_named_by_path() -> None:
    r0, r1 = run_ranks(_betas_differ, 2, timeout=60)
    assert r0 == r1 == [["param_groups.0.betas.1"], ["param_groups.0.betas.1"]]


# -- lazy conjugate / negative bits ---------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 40_000], ids=["small", "large"])
def test_a_conjugate_or_negative_view_hashes_as_its_values_not_its_memory(n: int) -> None:
    z = torch.randn(n, dtype=torch.complex64)
    assert digest_tensor(z) != digest_tensor(z.conj())
    assert digest_tensor(z.conj()) == digest_tensor(z.conj().resolve_conj())
    imag = z.conj().imag  # a float view with the negative bit
    assert imag.is_neg()
    assert digest_tensor(imag) == digest_tensor(imag.resolve_neg())
    assert digest_tensor(imag) != digest_tensor(z.imag)
    assert list(digest_tensors([z, z.conj()])) == [digest_tensor(z), digest_tensor(z.conj().resolve_conj())]


def _conj_flip(rank: int, world: int) -> list[Any]:
    torch.manual_seed(0)
    model = nn.Module()
    model.z = nn.Parameter(torch.randn(4, dtype=torch.complex64))
    model.big = nn.Parameter(torch.randn(40_000, dtype=torch.complex64))
    auditor = Auditor(model, timeout_s=30)
    out = [auditor.audit().in_sync, auditor.audit().in_sync]  # the second one is served by the cache
    if rank == 1:  # same storage, same address, only the lazy conjugate bit differs
        model.z.data = model.z.data.conj()
    out.append(sorted(m.name for m in auditor.audit().mismatches))
    if rank == 1:
        model.z.data = model.z.data.conj()
    out.append(auditor.audit().in_sync)
    out.append(auditor.audit().in_sync)
    if rank == 1:
        model.big.data = model.big.data.conj()
    out.append(sorted(m.name for m in auditor.audit().mismatches))
    return out


def test_a_conjugate_bit_flipped_on_one_rank_is_seen_on_the_cached_path() -> None:
    r0, r1 = run_ranks(_conj_flip, 2, timeout=60)
    assert r0 == r1 == [True, True, ["z"], True, True, ["big"]]


# -- storage freed under a tensor: refused by name, never read ------------------------------------


def _freed(rank: int, world: int, which: str, when: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(300, 300))  # a small and a large (360 KB) weight
    auditor = Auditor(model, timeout_s=30)
    if when == "cached":
        assert auditor.audit().in_sync and auditor.audit().in_sync
    if rank == 1:
        p = model[0].weight if which == "small" else model[1].weight
        p.untyped_storage().resize_(0 if which != "shrunk" else 8)
    try:
        auditor.audit()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("when", ["first", "cached"])
@pytest.mark.parametrize("which", ["small", "large", "shrunk"])
def test_a_freed_storage_is_refused_by_name_on_every_rank_never_read(which: str, when: str) -> None:
    # Ranks are separate processes: a read of freed memory would crash rank 1, failing this test.
    out = run_ranks(_freed, 2, which, when, timeout=60, expect_errors=True)
    name = "0.weight" if which == "small" else "1.weight"
    assert "UnauditableTensorError" in out[1] and name in out[1] and "storage" in out[1]
    assert "AuditPreparationError" in out[0] and name in out[0]  # rank 0 raises together, naming it


def test_a_view_beyond_its_storage_is_refused_by_name() -> None:
    t = torch.zeros(16)
    view = t[4:]
    t.untyped_storage().resize_(16)  # 4 floats left: the view reaches 12 past them
    model = nn.Module()
    model.register_buffer("view", view)
    with pytest.raises(UnauditableTensorError, match="'view'.*storage"):
        audit(model)
    with pytest.raises(UnauditableTensorError, match="storage"):
        digest_tensor(view)


# -- the trainable flag is part of the structure ----------------------------------------------------


def _frozen(rank: int, world: int, when: str) -> list[Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    auditor = Auditor(model, timeout_s=30)
    out = []
    if when == "cached":
        out = [auditor.audit().in_sync, auditor.audit().in_sync]
    if rank == 1:
        model[0].weight.requires_grad_(False)  # bytes equal; only the flag differs
    r = auditor.audit()
    out.append([(m.name, m.kind, m.ranks, m.detail) for m in r.mismatches])
    out.append(r.hints)
    if rank == 1:
        model[0].weight.requires_grad_(True)
    out.append(auditor.audit().in_sync)
    return out


@pytest.mark.parametrize("when", ["first", "cached"])
def test_a_parameter_frozen_on_one_rank_only_is_a_structure_mismatch_naming_it(when: str) -> None:
    r0, r1 = run_ranks(_frozen, 2, when, timeout=60)
    assert r0 == r1
    (mismatch,) = r0[-3]
    assert mismatch[:3] == ("0.weight", "structure", [1])  # a tie: the reference is rank 0's side
    assert "frozen (requires_grad=False) on rank 1" in mismatch[3]
    assert any("frozen on others (requires_grad differs)" in h for h in r0[-2]), r0[-2]
    assert r0[-1] is True


def test_frozen_everywhere_is_in_sync_and_the_flag_changes_the_structure_digest() -> None:
    model = nn.Linear(2, 2)
    a = build_manifest(model)
    model.weight.requires_grad_(False)
    b = build_manifest(model)
    assert [e.frozen for e in b.entries] == [True, False]
    from weightsync_audit.engine.hashing.digest import structure_digest

    assert structure_digest(a.entries) != structure_digest(b.entries)
    assert audit(model).in_sync
