"""Hostile and odd input: each case either audits correctly or gets one clear error naming the tensor,
on every rank together (never a hang, never a false alarm)."""

from __future__ import annotations

import gc
import io
import json
import math
import resource
import struct
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import RankFailed, run_ranks
from rich.console import Console
from torch import nn

from weightsync_audit import AuditResult, UnauditableTensorError, audit
from weightsync_audit.reporting.jsonl import ReportWriter, read_report
from weightsync_audit.reporting.render import render_group

# -- sparse, meta and other layouts: one clear error naming the tensor ------------------------------


def test_sparse_buffer_is_refused_with_an_error_naming_it() -> None:
    m = nn.Module()
    m.register_buffer("unset", None)  # legal: a None buffer is skipped by named_buffers
    m.register_buffer("coo", torch.eye(3).to_sparse())
    with pytest.raises(UnauditableTensorError, match="'coo'.*sparse COO.*exclude it or convert") as info:
        audit(m)
    assert info.value.name == "coo"
    # The way out the message offers works.
    assert audit(m, exclude=["coo"]).in_sync


def test_sparse_csr_and_meta_tensors_are_refused_naming_them() -> None:
    m = nn.Module()
    m.register_buffer("csr", torch.eye(3).to_sparse_csr())
    with pytest.raises(UnauditableTensorError, match="'csr'.*layout"):
        audit(m)
    meta = nn.Linear(2, 2, device="meta")
    with pytest.raises(UnauditableTensorError, match="'weight'.*meta tensor"):
        audit(meta)


def _sparse_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    m = nn.Linear(2, 2)
    if rank == 1:
        m.register_buffer("emb_grad", torch.eye(2).to_sparse())
    try:
        audit(m, timeout_s=20)
    except Exception as exc:  # noqa: BLE001 - the test inspects which error each rank got
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


def test_sparse_tensor_on_one_rank_makes_every_rank_raise_together_naming_it() -> None:
    r0, r1 = run_ranks(_sparse_on_one_rank, 2, timeout=60)
    assert r1["type"] == "UnauditableTensorError" and "emb_grad" in r1["message"]
    assert r0["type"] == "AuditPreparationError", r0
    assert "rank 1" in r0["message"] and "emb_grad" in r0["message"]


def _sparse_grads(rank: int, world: int) -> dict[str, Any]:
    emb = nn.Embedding(5, 2, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    try:
        audit(emb, include=("params", "grads"), timeout_s=20)
    except UnauditableTensorError as exc:
        return {"name": exc.name, "kind_in_message": "sparse" in str(exc)}
    return {}


def test_sparse_gradient_of_an_embedding_is_named_when_grads_are_audited() -> None:
    for r in run_ranks(_sparse_grads, 2, timeout=60):
        assert r == {"name": "weight", "kind_in_message": True}


# -- DTensor: the local shard, and only where comparing shards makes sense ------------------------


def _dtensor(rank: int, world: int, layout: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    full = torch.randn(8, 4)
    m = nn.Module()
    if layout == "replicate":
        mesh = init_device_mesh("cpu", (world,))
        m.w = nn.Parameter(distribute_tensor(full, mesh, [Replicate()]))
        group = None
    elif layout == "shard":
        mesh = init_device_mesh("cpu", (world,))
        m.w = nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        group = None
    else:  # HSDP: replicate over mesh dim 0, shard over dim 1; audit the replicas of each shard
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        m.w = nn.Parameter(distribute_tensor(full, mesh, [Replicate(), Shard(0)]))
        group = mesh.get_group("replicate")
    if rank == 1:
        with torch.no_grad():
            m.w.to_local()[0, 0] += 1.0
    r = audit(m, group=group, step=0, timeout_s=20)
    dist.barrier()  # rank 0's process hosts the job's store: it stays up until every group is done
    return {"in_sync": r.in_sync, "mismatches": [(x.name, x.ranks) for x in r.mismatches], "notes": r.notes}


def test_replicated_dtensor_is_audited_and_a_diverged_replica_is_named() -> None:
    results = run_ranks(_dtensor, 3, "replicate", timeout=60)
    for r in results:
        assert r["mismatches"] == [("w", [1])]
        assert not any("no replica" in n for n in r["notes"])  # replicated: every rank is a peer


def test_dtensor_sharded_across_the_audited_ranks_is_left_out_with_a_note_not_a_false_alarm() -> None:
    for r in run_ranks(_dtensor, 2, "shard", timeout=60):
        assert r["in_sync"] is True  # shards differ by design: comparing them would be a false alarm
        assert any(n.startswith("1 sharded tensor has no replica to compare") for n in r["notes"]), r


def test_hsdp_dtensor_audited_over_the_replicate_group_compares_replicas_of_each_shard() -> None:
    # Mesh [[0, 1], [2, 3]]: rank 1 and rank 3 hold the same shard; rank 1's copy was changed.
    results = run_ranks(_dtensor, 4, "hsdp", timeout=90)
    assert results[0]["in_sync"] and results[2]["in_sync"]
    # Ranks in a result are global ranks, like in every error; with 2 ranks in the group the tie goes to
    # the lower one (global 1), so global rank 3 is the one reported.
    assert results[1]["mismatches"] == results[3]["mismatches"] == [("w", [3])]
    assert not any("no replica" in n for n in results[1]["notes"])


# -- Python values in optimizer state --------------------------------------------------------------


class _OddStateSGD(torch.optim.SGD):
    """An optimizer that keeps numbers, None, lists, tuples and strings in its state."""

    def __init__(self, params: Any, rank: int, differ: bool) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.rank, self.differ = rank, differ

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                st["count"] = 3
                st["scale"] = 0.5
                st["nothing"] = None
                st["history"] = [1.0, 2.5, math.inf]
                st["shape_hint"] = (2, 3)
                st["tag"] = "warmup"
                if self.differ and self.rank == 1:
                    st["history"] = [1.0, 2.5, 4.0]
                    st["tag"] = "warmup'; import os"  # a string is data, never evaluated
        g0 = self.param_groups[0]
        g0["custom_none"] = None
        g0["betas_like"] = (0.9, 0.999)
        return out


def _odd_state(rank: int, world: int, differ: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    opt = _OddStateSGD(m.parameters(), rank, differ)
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    r = audit(m, opt, timeout_s=20)
    return {"in_sync": r.in_sync, "mismatches": sorted(x.name for x in r.mismatches), "checked": r.checked}


def test_non_tensor_optimizer_state_is_audited_and_a_differing_value_is_named() -> None:
    same = run_ranks(_odd_state, 2, False, timeout=60)
    assert all(r["in_sync"] for r in same)
    # 2 params x (momentum_buffer + 6 values), plus the group's hyper-parameters
    assert same[0]["checked"]["optimizer"] >= 14
    diff = run_ranks(_odd_state, 2, True, timeout=60)
    assert diff[0]["mismatches"] == ["bias.history", "bias.tag", "weight.history", "weight.tag"]


# -- empty and huge models ------------------------------------------------------------------------


def _empty(rank: int, world: int) -> dict[str, Any]:
    r = audit(nn.Module(), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), timeout_s=20)
    return r.to_dict()


def test_empty_model_is_in_sync_with_nothing_checked() -> None:
    for rec in run_ranks(_empty, 2, timeout=60):
        assert rec["in_sync"] is True and rec["checked"]["param"] == rec["checked"]["buffer"] == 0


def _million(rank: int, world: int) -> dict[str, Any]:
    m = nn.Module()
    # A million one-element buffers (views of one storage; building them through register_buffer
    # would take longer than the audit). Built with the collector off (it would rescan the growing heap
    # over and over: 4x the build time); the audit runs with it on, as in any process.
    gc.disable()
    try:
        m._buffers.update({f"t{i}": v for i, v in enumerate(torch.zeros(1_000_000, 1).unbind())})
    finally:
        gc.enable()
    if rank == 1:
        m._buffers["t765432"] += 1.0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = audit(m, step=0, timeout_s=60)
    return {
        "extra_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
        "checked": r.checked["buffer"],
        "mismatches": [(x.name, x.ranks, x.max_abs_diff) for x in r.mismatches],
    }


def test_a_million_tiny_tensors_are_audited_and_the_odd_one_is_named() -> None:
    # No timed assert (speed is measured, not tested): run_ranks' timeout is only the hang guard. About
    # 6-8 s per audit on 2 idle cores, divergence path included; longer on a loaded one.
    for r in run_ranks(_million, 2, timeout=300):
        assert r["checked"] == 1_000_000
        assert r["mismatches"] == [("t765432", [1], 1.0)]
        assert r["extra_mib"] < 1500, r  # about 0.5 GiB over the model itself


# -- NaN and inf: bitwise ------------------------------------------------------------------------


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _nan_inf(rank: int, world: int) -> dict[str, Any]:
    m = nn.Module()
    m.register_buffer("same_nan", torch.tensor([math.nan, math.inf, -math.inf, 1.0]))
    payload = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    m.register_buffer("nan_payload", payload.clone())
    m.register_buffer("signed_zero", torch.tensor([0.0]))
    m.register_buffer("inf_sign", torch.tensor([math.inf]))
    if rank == 1:
        m.nan_payload.view(torch.int32)[0] = 0x7FC00001  # another NaN: equal as values, not as bits
        m.signed_zero.neg_()  # -0.0 == 0.0 as values, not as bits
        m.inf_sign.neg_()
    r = audit(m, timeout_s=20)
    return {x.name: (x.ranks, x.max_abs_diff, x.detail) for x in r.mismatches}


def test_nan_and_inf_are_compared_bitwise() -> None:
    got = run_ranks(_nan_inf, 2, timeout=60)[0]
    assert "same_nan" not in got  # NaNs with equal bits agree
    assert set(got) == {"nan_payload", "signed_zero", "inf_sign"}
    assert math.isinf(got["inf_sign"][1]) and "NaN or inf" in got["inf_sign"][2]
    for name in ("nan_payload", "signed_zero"):
        ranks, diff, _detail = got[name]
        assert ranks == [1] and diff == 0.0, got  # equal as values: the difference is in the bits only


# -- odd names in results, reports and terminal output ------------------------------------------

ODD_NAMES = [
    "a b",
    'quote"and\\backslash',
    "new\nline",
    "[red]markup[/red]",
    "émoji🙂",
    "line\u2028sep",
    "lone\ud800surrogate",
    "{json}",
]


def _odd_names(rank: int, world: int) -> dict[str, Any]:
    m = nn.Module()
    for i, n in enumerate(ODD_NAMES):
        m.register_buffer(n, torch.full((2,), float(i)))
    if rank == 1:
        for n in ODD_NAMES:
            getattr(m, n).add_(1.0)
    return audit(m, step=1, timeout_s=20).to_dict()


def test_names_with_odd_characters_survive_the_exchange_the_report_and_the_terminal(tmp_path: Any) -> None:
    rec = run_ranks(_odd_names, 2, timeout=60)[0]
    assert sorted(x["name"] for x in rec["mismatches"]) == sorted(ODD_NAMES)
    # report: written, read back identical
    path = tmp_path / "audit.jsonl"
    with ReportWriter(path) as w:
        w.write(rec)
    [(_, back)] = read_report(path).records
    assert sorted(x.name for x in back.mismatches) == sorted(ODD_NAMES)
    assert path.read_bytes().count(b"\n") == 1  # one record, one line: newlines in names are escaped
    # terminal: names are shown literally, markup in a name is never interpreted
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(render_group(AuditResult.from_dict(rec)))
    text = out.getvalue()
    assert "[red]markup[/red]" in text
    assert "émoji🙂" in text


def test_a_report_record_is_data_never_code(tmp_path: Any) -> None:
    rec = AuditResult(in_sync=True, step=1).to_dict()
    rec["hook"] = "__import__('os').system('touch pwned')"
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    [(_, back)] = read_report(path).records
    assert back.hook == rec["hook"] and not (tmp_path / "pwned").exists()


# -- several devices -------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensors_on_several_devices_are_audited_each_where_it_lives() -> None:
    m = nn.Module()
    m.register_buffer("cpu", torch.arange(10.0))
    m.register_buffer("gpu", torch.arange(10.0, device="cuda"))
    r = audit(m)
    assert r.in_sync and r.checked["buffer"] == 2
    # the same bytes give the same digest wherever they live (on-device digest for both)
    from weightsync_audit.engine.hashing.device_digest import device_digests
    from weightsync_audit.engine.hashing.digest import digest_tensor

    assert device_digests([m.cpu])[0] == device_digests([m.gpu])[0]
    assert digest_tensor(m.cpu) == digest_tensor(m.cpu.clone())


def _cpu_and_device_method(rank: int, world: int) -> list[str]:
    m = nn.Sequential(nn.Linear(4, 4))
    torch.manual_seed(0)
    nn.init.normal_(m[0].weight)
    if rank == 1:
        with torch.no_grad():
            m[0].bias[2] = torch.nextafter(m[0].bias[2], torch.tensor(1.0))
    from weightsync_audit import Auditor

    # method="device" runs the on-device digest on CPU tensors: the accelerator path, tested here.
    r = Auditor(m, method="device", timeout_s=20).audit()
    return [x.name for x in r.mismatches]


def test_on_device_digest_path_finds_a_one_ulp_change() -> None:
    assert run_ranks(_cpu_and_device_method, 2, timeout=60) == [["0.bias"], ["0.bias"]]


def test_run_ranks_reports_a_raising_rank() -> None:
    # Guard for the helpers above: a rank's exception surfaces as RankFailed, not a hang.
    def boom(rank: int, world: int) -> None:
        dist.barrier()
        if rank == 1:
            raise ValueError("boom")

    out = run_ranks(boom, 2, timeout=60, expect_errors=True)
    assert isinstance(out[1], RankFailed) and "boom" in str(out[1])
