"""The fault-injection campaign's training loop and its catalogue of faults (one rank, one step, one cause).

Each run is a plain gloo DDP loop (``broadcast_buffers=False``, so a buffer fault stays a fault) over a
tiny model with parameters, a BatchNorm-like float buffer and an int64 counter, trained with Adam. One
fault from :data:`FAULTS` is injected on one rank at one step; the loop records, at every step, an
independent byte-level snapshot of everything the audit covers (:mod:`campaign_oracle`), next to what
:class:`weightsync_audit.Auditor` said at each audit. Healthy runs and not-a-fault controls use the same loop.
"""

from __future__ import annotations

import copy
import math
import random
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from campaign_oracle import EXPERT_GROUP, snapshot, snapshot_fsdp1
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from weightsync_audit import Auditor, declare_replicas

FAULTS: dict[str, str] = {
    "flip_param_high": "one exponent bit (23-30) of one float32 parameter element flipped",
    "flip_param_low": "one low mantissa bit (0-3) of one float32 parameter element flipped",
    "flip_exp_avg": "one bit (0-30) of one element of Adam's exp_avg flipped",
    "buffer_changed": "one element of the BatchNorm-like running_mean moved by 0.25",
    "lr_one_step": "the learning rate x10 on one rank for one optimizer step",
    "skip_step": "optimizer.step() skipped on one rank (the loop still calls record_step)",
    "skip_step_unrecorded": "the whole step body skipped on one rank: no optimizer.step(), no record_step",
    "grad_after_reduce": "a gradient halved after DDP's all-reduce on one rank (local clipping)",
    "frozen_one_rank": "a parameter frozen (requires_grad=False) on one rank after the wrap, find_unused_parameters",
    "ckpt_rank0": "a checkpoint (saved at step 2) loaded into model and optimizer on rank 0 only",
    "nonfinite_state": "one element of Adam's exp_avg_sq set to +inf on one rank",
    "counter_off_by_one": "the int64 num_batches_tracked counter off by one on one rank",
    "nan_param": "one parameter element set to NaN on one rank (spreads to every rank through the all-reduce)",
    "counter_under_tolerance": "the int64 counter at 200,000+ off by one on one rank, audited with tolerance=1e-4",
    "sampled_checkpoint": (
        'one element of an 80 KB buffer moved by 1.0 on one rank, in a run sampled at coverage="1/8" whose every '
        "audit is a checkpoint save (checkpoint_saved and its sidecar)"
    ),
}
"""Faulty kinds: what each injects."""

HEALTHY: dict[str, str] = {
    "healthy_every4": "no fault, audit every 4 steps",
    "healthy_every3_tolerance": "no fault, audit every 3 steps with tolerance=1e-6",
    "healthy_sampled_every5": 'no fault, audit every 5 steps with coverage="1/4"',
}
CONTROLS: dict[str, str] = {
    "control_equal_copy": "a parameter replaced by an equal copy (p.data = p.data.clone()) on one rank",
    "control_set_equal_storage": "the running_mean buffer set_() to another storage holding equal bytes on one rank",
    "control_state_equal_copy": "Adam's exp_avg of a parameter replaced by an equal copy on one rank",
}
"""Not-a-fault controls: the objects change, the bytes do not; nothing may be reported."""

PARTIAL: dict[str, str] = {
    "fsdp1_state_lost": "FSDP1 FULL_SHARD in place of DDP: one rank's optimizer state lost (opt.state cleared, "
    "as after a failed load) after a step; its shards' state has no replica",
    "stage_replica_frozen": "pipeline stages declared with declare_replicas (2 stages x 2 replicas on 4 ranks, one "
    "stage on 2), no DDP, gradients averaged within each stage's group: a parameter frozen on one replica after its step",
    "expert_missing": "the last layer declared as the experts with declare_replicas (groups {0, 2} and {1, 3} on 4 "
    "ranks, each its own expert; {0, 1} on 2), no DDP: one rank loses its expert's bias (from the module and the "
    "optimizer, as after a partial load) after its step",
}
"""Partial-replica faults: tensors held by some ranks only (run by name: ``--kinds``)."""

PARAMS = ("0.weight", "0.bias", "1.weight", "3.weight", "3.bias")
STEPS = 24
TABLE = 20_000
"""Elements of the ``sampled_checkpoint`` kind's buffer ``2.table`` (80 KB: over the size a sampled audit
hashes whole, so one audit reads only a slice of it)."""


class RunningNorm(nn.Module):
    """BatchNorm-like: a float running statistic and an int64 counter, updated at every training forward.

    The update reads only replicated values (this layer's weight), so healthy replicas keep equal bytes;
    a real BatchNorm fed per-rank batches without buffer broadcast would diverge by design.
    """

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(self.weight.detach(), alpha=0.1)
                self.num_batches_tracked += 1
        return (x - self.running_mean) * self.weight + self.bias


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), RunningNorm(16), nn.Tanh(), nn.Linear(16, 4))


@dataclass(frozen=True)
class RunSpec:
    """One run: every rank gets the same spec, so every rank takes the same decisions."""

    run_id: str
    world: int
    kind: str
    seed: int
    cadence: int = 4
    coverage: str = "1"
    tolerance: float | None = None
    fault_step: int | None = None
    fault_rank: int | None = None
    target: str = "0.weight"
    index: int = 0
    bit: int = 0
    steps: int = STEPS

    @property
    def faulty(self) -> bool:
        return self.kind in FAULTS or self.kind in PARTIAL


def make_spec(world: int, kind: str, n: int, base_seed: int) -> RunSpec:
    """The ``n``-th run of ``kind`` on ``world`` ranks, every random choice drawn from one seeded stream."""
    seed = zlib.crc32(f"{base_seed}/{world}/{kind}/{n}".encode())
    rng = random.Random(seed)
    fixed = {"healthy_every4": 4, "healthy_every3_tolerance": 3, "healthy_sampled_every5": 5}
    cadence = fixed.get(kind, rng.choice((3, 4, 4, 5)))
    step = rng.randint(cadence + 1, STEPS - cadence)  # after the first audit, at least one audit after it
    rank = 0 if kind == "ckpt_rank0" else rng.randrange(world)
    target = rng.choice(PARAMS)
    numel = dict(zip(PARAMS, (128, 16, 16, 64, 4)))[target]
    bit = {"flip_param_high": rng.randint(23, 30), "flip_param_low": rng.randint(0, 3)}.get(kind, rng.randint(0, 30))
    return RunSpec(
        run_id=f"w{world}-{kind}-{n}",
        world=world,
        kind=kind,
        seed=seed,
        cadence=cadence,
        coverage={"healthy_sampled_every5": "1/4", "sampled_checkpoint": "1/8"}.get(kind, "1"),
        tolerance={"healthy_every3_tolerance": 1e-6, "counter_under_tolerance": 1e-4}.get(kind),
        fault_step=step if kind not in HEALTHY else None,
        fault_rank=rank if kind not in HEALTHY else None,
        target=target,
        index=rng.randrange(TABLE if kind == "sampled_checkpoint" else numel),
        bit=bit,
    )


def _flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    flat = t.detach().view(-1)
    (word,) = struct.unpack("<I", struct.pack("<f", float(flat[index])))
    (flat[index],) = struct.unpack("<f", struct.pack("<I", word ^ (1 << bit)))


class Injector:
    """Applies ``spec``'s fault on ``rank`` at the right moments of step ``spec.fault_step``."""

    def __init__(self, spec: RunSpec, rank: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.spec, self.model, self.opt = spec, model, opt
        self.param = dict(model.named_parameters()).get(spec.target)  # None under FSDP1 (flattened)
        self.saved: tuple[Any, Any] | None = None
        self.lr: float | None = None
        self.mine = spec.fault_rank == rank
        if spec.kind == "counter_under_tolerance":  # a long run: 1 in 200,000 is far inside tolerance=1e-4
            model[1].num_batches_tracked.fill_(200_000)

    def active(self, step: int) -> bool:
        return self.mine and step == self.spec.fault_step

    def before_forward(self, step: int) -> None:
        if step == 2 and self.spec.kind == "ckpt_rank0":
            self.saved = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()))
        if self.active(step) and self.spec.kind == "frozen_one_rank":
            self.param.requires_grad_(False)

    def before_optimizer_step(self, step: int) -> None:
        if not self.active(step):
            return
        if self.spec.kind == "lr_one_step":
            self.lr = self.opt.param_groups[0]["lr"]
            self.opt.param_groups[0]["lr"] = self.lr * 10
        elif self.spec.kind == "grad_after_reduce" and self.param.grad is not None:
            self.param.grad.mul_(0.5)

    def skips_step(self, step: int) -> bool:
        return self.active(step) and self.spec.kind in ("skip_step", "skip_step_unrecorded")

    def skips_record(self, step: int) -> bool:
        return self.active(step) and self.spec.kind == "skip_step_unrecorded"

    @torch.no_grad()
    def after_optimizer_step(self, step: int) -> None:
        if not self.active(step):
            return
        kind, p, i = self.spec.kind, self.param, self.spec.index
        if kind == "fsdp1_state_lost":
            self.opt.state.clear()
            return
        if kind == "stage_replica_frozen":  # after its step: an audit at this step sees the flag alone
            p.requires_grad_(False)
            return
        if kind == "expert_missing":  # the expert's bias gone from the module and from the optimizer
            bias = self.model[3].bias
            self.model[3].register_parameter("bias", None)
            for group in self.opt.param_groups:
                group["params"] = [q for q in group["params"] if q is not bias]
            self.opt.state.pop(bias, None)
            return
        state = self.opt.state[p]
        if kind in ("flip_param_high", "flip_param_low"):
            _flip_bit(p, i, self.spec.bit)
        elif kind == "flip_exp_avg":
            _flip_bit(state["exp_avg"], i, self.spec.bit)
        elif kind == "buffer_changed":
            self.model[1].running_mean[i % 16] += 0.25
        elif kind == "lr_one_step":
            self.opt.param_groups[0]["lr"] = self.lr
        elif kind == "ckpt_rank0":
            assert self.saved is not None
            self.model.load_state_dict(self.saved[0])
            self.opt.load_state_dict(self.saved[1])
        elif kind == "nonfinite_state":
            state["exp_avg_sq"].view(-1)[i] = math.inf
        elif kind in ("counter_off_by_one", "counter_under_tolerance"):
            self.model[1].num_batches_tracked += 1
        elif kind == "nan_param":
            p.view(-1)[i] = math.nan
        elif kind == "control_equal_copy":
            p.data = p.data.clone()
        elif kind == "control_set_equal_storage":  # on a parameter, set_ would cut DDP's gradient hook
            self.model[1].running_mean.set_(self.model[1].running_mean.clone())
        elif kind == "control_state_equal_copy":
            state["exp_avg"] = state["exp_avg"].clone()
        elif kind == "sampled_checkpoint":
            self.model[2].table[i] += 1.0


def train(spec: RunSpec, rank: int, world: int) -> dict[str, Any]:
    """One run on this rank: the audit records (identical on every rank) and this rank's per-step snapshots."""
    torch.manual_seed(spec.seed % 2**31)
    model = make_model()
    if spec.kind == "sampled_checkpoint":  # a buffer large enough to be sampled, equal on every rank
        model[2].register_buffer("table", torch.randn(TABLE, generator=torch.Generator().manual_seed(3)))
    fsdp1, staged = spec.kind == "fsdp1_state_lost", spec.kind == "stage_replica_frozen"
    experts = spec.kind == "expert_missing"
    if staged:
        model, ddp, group, stage = _stage(spec, rank, world)
    elif experts:
        model, ddp, group, stage = _experts(spec, rank, world)
        shapes = [(n, p.shape) for n, p in model.named_parameters()]
    elif fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        ddp = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"))
    else:
        with warnings.catch_warnings():  # broadcast_buffers is deprecated, and still the way to keep buffers rank-local
            warnings.simplefilter("ignore", FutureWarning)
            ddp = DDP(model, broadcast_buffers=False, find_unused_parameters=spec.kind == "frozen_one_rank")
    opt = torch.optim.Adam(ddp.parameters() if fsdp1 else model.parameters(), lr=1e-2)
    auditor = Auditor(ddp, opt, pinpoint=True, timeout_s=30, coverage=spec.coverage, tolerance=spec.tolerance)
    inject = Injector(spec, rank, model, opt)
    gen = torch.Generator().manual_seed(spec.seed % 2**31 + 1000 * (rank + 1))
    w_true = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    records: list[dict[str, Any]] = []
    oracle: dict[int, dict[str, bytes]] = {}
    for step in range(1, spec.steps + 1):
        inject.before_forward(step)
        x = torch.randn(16, 8, generator=gen)
        loss = (ddp(x) - x @ w_true).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if staged:
            _average_grads(model, group)
        elif experts:
            _average_expert_grads(model, shapes, group)
        inject.before_optimizer_step(step)
        if not inject.skips_step(step):
            opt.step()
        inject.after_optimizer_step(step)
        oracle[step] = snapshot_fsdp1(ddp, opt) if fsdp1 else snapshot(model, opt)
        if staged:  # named as the audit names a declared stage's tensors
            oracle[step] = {f"stage{stage}.{k}": v for k, v in oracle[step].items()}
        elif experts:  # which experts this rank holds: the oracle compares them within the group
            oracle[step][EXPERT_GROUP] = str(stage).encode()
        if not inject.skips_record(step):
            auditor.record_step(step)
        if step % spec.cadence == 0:
            result = _checkpoint(auditor, spec, rank, step) if spec.kind == "sampled_checkpoint" else None
            records.append(_same_everywhere((result or auditor.audit(step=step)).to_dict()))
    return {"records": records, "oracle": oracle}


def _stage(spec: RunSpec, rank: int, world: int) -> tuple[nn.Module, nn.Module, Any, int]:
    """This rank's pipeline stage (stage ``rank % stages``, 2 stages from 4 ranks, else 1), its own weights
    (seeded by stage), declared with its data-parallel group; every rank creates every group, in order."""
    stages = 2 if world >= 4 else 1
    groups = [dist.new_group([r for r in range(world) if r % stages == s]) for s in range(stages)]
    stage = rank % stages
    torch.manual_seed(spec.seed % 2**31 + stage)
    model = declare_replicas(make_model(), stage=stage, stage_group=groups[stage])
    return model, model, groups[stage], stage


def _experts(spec: RunSpec, rank: int, world: int) -> tuple[nn.Module, nn.Module, Any, int]:
    """This rank's model: the dense layers alike everywhere, the last layer its expert group's own (2 groups
    from 4 ranks, else 1), declared with ``experts="3.*"`` and the group; every rank creates every group."""
    n = 2 if world >= 4 else 1
    groups = [dist.new_group([r for r in range(world) if r % n == c]) for c in range(n)]
    coord = rank % n
    model = make_model()
    torch.manual_seed(spec.seed % 2**31 + 100 + coord)
    model[3].reset_parameters()
    return declare_replicas(model, experts="3.*", expert_group=groups[coord]), model, groups[coord], coord


def _average_expert_grads(model: nn.Module, shapes: list[tuple[str, Any]], group: Any) -> None:
    """Dense gradients averaged over every rank, the expert's within its group; a tensor this rank lost
    contributes zeros (the same collectives on every rank)."""
    params = dict(model.named_parameters())
    for name, shape in shapes:
        p = params.get(name)
        g = p.grad if p is not None and p.grad is not None else torch.zeros(shape)
        where = group if name.startswith("3.") else None
        dist.all_reduce(g, group=where)
        if p is not None and p.grad is not None:
            p.grad.div_(dist.get_world_size(where))


def _average_grads(model: nn.Module, group: Any) -> None:
    """DDP's all-reduce by hand within the stage's group (a frozen parameter contributes zeros)."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        if p.grad is not None:
            p.grad.div_(n)


def _checkpoint(auditor: Auditor, spec: RunSpec, rank: int, step: int) -> Any:
    """A checkpoint save at this audit (rank 0 writes the file, then every rank writes its sidecar's verdict):
    the record the sidecar's verdict comes from, its ``checkpoint`` entry included."""
    import os
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"weightsync-campaign-{os.getppid()}-{spec.run_id}.pt")
    module = auditor.module
    assert module is not None
    if rank == 0:
        torch.save(getattr(module, "module", module).state_dict(), path)
    result = auditor.checkpoint_saved(path, step)
    dist.barrier()
    if rank == 0:
        for leftover in (path, path + ".weightsync.json"):
            if os.path.exists(leftover):
                os.remove(leftover)
    return result


def _same_everywhere(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("time", "duration_ms")}


def run_on_rank(spec: RunSpec, rank: int, world: int) -> dict[str, Any]:
    """Train, then gather every rank's snapshots on every rank (rank 0 hands them to the parent, which compares)."""
    try:
        out: dict[str, Any] = train(spec, rank, world)
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - the campaign reports it as a crash of this run
        out = {"records": [], "oracle": {}, "error": f"{type(exc).__name__}: {exc}"}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, out)  # every rank learns of an error (the batch then stops everywhere)
    errors = [g["error"] for g in gathered]
    if not any(errors) and any(g["records"] != gathered[0]["records"] for g in gathered):
        errors[0] = "the ranks returned different audit records"  # the contract: the same record everywhere
    return {"records": gathered[0]["records"], "oracles": [g["oracle"] for g in gathered], "errors": errors}
