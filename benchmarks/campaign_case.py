"""One run of the combination campaign: its :class:`Case`, the model, the optimizers and the planted fault.

A row of the all-pairs design (:mod:`campaign_cover`) gives four runs: ``healthy``, ``fault0`` (the row's
fault planted on rank 0), ``fault1`` (on rank 1) and ``fault01`` (on rank 0, then on rank 1 right after the
audit that found the first was acted on: a second divergence, found by the next audit), the same seed and data
otherwise. Every random choice
(the fault's step, tensor, element and bit) is drawn from the row's seed, so every rank takes the same
decisions. :class:`Faults` plants the fault at the points every adapter reaches alike: the start of an
optimizer step (a change at rest), and the optimizer's own pre- and post-step hooks (a learning rate, a
compute fault inside the update), registered before the library's own hooks.
"""

from __future__ import annotations

import ctypes
import random
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import torch
from campaign_cover import FACTORS, FOCUS_ONLY, Row
from torch import nn

STEPS = 12
"""Optimizer steps per run."""
EVERY = 2
"""The audit cadence (steps)."""
BATCH = 4
VOCAB = 1100
"""Embedding rows: 1100 x 16 float32 is 70,400 bytes, over the 64 KiB from which ``coverage="1/4"`` samples."""
TOKENS = 6
CLAMP = 0.5
"""The post-step clamp's bound (WGAN-style ``p.clamp_(-c, c)`` under ``no_grad``)."""
VARIANTS = ("healthy", "fault0", "fault1", "fault01")


@dataclass(frozen=True)
class Case:
    """One run: a row of the design, the variant, and the drawn details. The same on every rank."""

    run_id: str
    row: int
    variant: str
    adapter: str
    optimizer: str
    pattern: str
    fault: str
    world: int
    attribution: bool
    overlap: bool
    on_mismatch: str
    pinpoint: bool
    coverage: str
    tolerance: float | None
    check_batches: bool
    grads: bool
    seed: int
    fault_step: int
    target: str
    element: int
    bit: int
    dup_step: int

    @property
    def faulty_rank(self) -> int | None:
        """The rank of the (first) fault; ``None`` for a healthy run."""
        return {"fault0": 0, "fault1": 1, "fault01": 0}.get(self.variant)

    def plants(self) -> list[tuple[int, int]]:
        """``(rank, step)`` of every fault of this run."""
        if self.faulty_rank is None:
            return []
        first = [(self.faulty_rank, self.fault_step)]
        found = -(-self.fault_step // EVERY) * EVERY  # the audit that finds the first fault
        return [*first, (1, found + EVERY)] if self.variant == "fault01" else first  # found by the next audit

    def corrupted_at(self, step: int) -> int | None:
        """The rank whose fault is the latest planted at or before ``step`` (``None``: none yet, or healthy)."""
        return next((r for r, s in reversed(self.plants()) if s <= step), None)

    def options(self) -> dict[str, Any]:
        """The audit options of this run, as the adapters take them (flat keywords)."""
        kw: dict[str, Any] = {
            "attribution": self.attribution,
            "overlap": self.overlap,
            "on_mismatch": self.on_mismatch,
            "pinpoint": self.pinpoint,
            "coverage": self.coverage,
            "tolerance": self.tolerance,
        }
        if self.grads:
            kw["include"] = ("params", "buffers", "optimizer", "grads")
        if self.check_batches:
            kw["check_batches"] = True
        return kw

    def describe(self) -> str:
        on = [k for k in ("attribution", "overlap", "pinpoint", "check_batches", "grads") if getattr(self, k)]
        extra = [f"coverage={self.coverage}"] if self.coverage != "1" else []
        extra += [f"tolerance={self.tolerance:g}"] if self.tolerance is not None else []
        return (
            f"{self.adapter} {self.optimizer}+{self.pattern} w{self.world} {self.on_mismatch}"
            f" [{','.join(on + extra) or 'defaults'}] {self.variant}"
            + (f" {self.fault}@{self.fault_step} {self.target}" if self.faulty_rank is not None else "")
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


TARGETS = ("emb.weight", "fc1.weight", "fc2.bias")
"""Where a bit flip lands (one of them, drawn); a rewrite is always of ``fc1.weight``, whole; a compute
fault inside the update lands in ``fc1.weight`` or ``fc2.weight`` (trainable under every pattern)."""


def make_cases(rows: list[Row], seed: int, variants: tuple[str, ...] = VARIANTS) -> list[Case]:
    """Every run of ``rows``: each row's variants, the row's draws shared by its runs."""
    out = []
    for i, row in enumerate(rows):
        s = zlib.crc32(f"pairs/{seed}/{i}".encode())
        rng = random.Random(s)
        fault_step = rng.randint(4, 7)
        flip_target = rng.choice(TARGETS)
        compute_target = rng.choice(("fc1.weight", "fc2.weight"))
        target = {"flip": flip_target, "write": "fc1.weight", "compute": compute_target, "grad": compute_target}.get(
            row["fault"], "fc1.weight"
        )
        element, bit = rng.randrange(1 << 20), rng.randint(16, 22)
        dup_step = rng.choice((4, 6, 8))
        for v in variants:
            out.append(Case(run_id=f"r{i:02d}-{v}", row=i, variant=v, seed=s, fault_step=fault_step, target=target,
                            element=element, bit=bit, dup_step=dup_step, **row))  # fmt: skip
    return out


def check_row(row: Row) -> None:
    """A row names a value of every factor (``ValueError`` otherwise)."""
    for f, values in FACTORS.items():
        values = (*values, *FOCUS_ONLY.get(f, ()))
        if row.get(f) not in values:
            raise ValueError(f"row {row}: {f}={row.get(f)!r} is not one of {values}")


class Net(nn.Module):
    """Token ids to four values: an embedding (sampled under ``coverage="1/4"``), two linear layers, and with
    ``ema`` an exponential moving average of the trainable weights as buffers (``ema.*``)."""

    def __init__(self, seed: int, ema: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed % 2**31)
        self.emb = nn.Embedding(VOCAB, 16)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)
        if ema:
            self.ema = nn.Module()
            for name, p in list(self.named_parameters()):
                self.ema.register_buffer(name.replace(".", "_"), p.detach().clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.emb(ids).mean(1))))

    def loss(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self(ids).float(), y)

    @torch.no_grad()
    def update_ema(self) -> None:
        for name, p in self.named_parameters():
            getattr(self.ema, name.replace(".", "_")).mul_(0.9).add_(p.detach(), alpha=0.1)


def batches(case: Case, rank: int, steps: int, per_step: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """This rank's micro-batches for each step (its own stream: data parallel). With ``check_batches``, rank 1
    trains on rank 0's batch at step ``dup_step`` (a sampler bug: the check must name it)."""

    def stream(r: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        g = torch.Generator().manual_seed(case.seed % 2**31 + 7919 * (r + 1))
        draw = [(torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g), torch.randn(BATCH, 4, generator=g))
                for _ in range(steps * per_step)]  # fmt: skip
        return [draw[i * per_step : (i + 1) * per_step] for i in range(steps)]

    out = stream(rank)
    if case.check_batches and rank == 1:
        out[case.dup_step - 1] = stream(0)[case.dup_step - 1]
    return out


def build_optimizer(case: Case, model: nn.Module) -> torch.optim.Optimizer:
    """The run's optimizer over ``model``'s parameters (two groups with ``groups``)."""
    params: Any = list(model.parameters())
    if case.pattern == "groups":
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        params = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "lr": 5e-3, "weight_decay": 0.0}]
    kind = case.optimizer
    if kind.startswith("adam"):
        flags = {"adam_fused": {"fused": True}, "adam_foreach": {"foreach": True}, "adam_single": {"foreach": False}}
        return torch.optim.Adam(params, lr=1e-2, **flags[kind])
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.LBFGS(params, lr=0.1, max_iter=2, history_size=4)


def freeze(case: Case, model: nn.Module) -> None:
    """``frozen``: the embedding is frozen before the DDP wrap (a fine-tuning run)."""
    if case.pattern == "frozen":
        model.emb.weight.requires_grad_(False)


def averaged(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` with the value of its mean over the ranks and its own gradient (DDP averages the gradients):
    what an LBFGS closure under DDP returns, so that every rank's line search and ``prev_loss`` agree."""
    import torch.distributed as dist

    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return loss - loss.detach() + mean / dist.get_world_size()  # x - x is exactly 0: the value is the mean's


def build_scheduler(case: Case, opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if case.pattern == "scheduler" else None


def named(model: nn.Module, suffix: str) -> torch.Tensor:
    """The parameter whose name ends with ``suffix`` (the adapters' models name it ``net.fc1.weight`` or
    ``fc1.weight``)."""
    for n, p in model.named_parameters():
        if n == suffix or n.endswith("." + suffix):
            return p
    raise KeyError(suffix)


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """One bit of one float32 element flipped as the memory does: behind torch's back, so that no version
    counter moves (on the CPU through its address, inside the tensor's own storage)."""
    index %= t.numel()
    if t.is_cpu and t.is_contiguous() and t.dtype == torch.float32:
        word = ctypes.c_uint32.from_address(t.data_ptr() + 4 * index)
        word.value ^= 1 << bit
        return
    with torch.no_grad():
        flat = t.detach().view(-1)
        word_t = flat[index].view(1).view(torch.int32)
        word_t ^= 1 << bit


class Faults:
    """The case's fault on this rank, at its step: call :meth:`at_start` at the start of every optimizer step
    (before its forward) with the step about to run; :meth:`attach` hooks the optimizer (before the library)."""

    def __init__(self, case: Case, rank: int, model: nn.Module) -> None:
        self.case, self.model = case, model
        self.mine = [s for r, s in case.plants() if r == rank]
        self.step = 0
        """The optimizer step under way (set by :meth:`at_start`)."""
        self.planted: list[int] = []
        self._lr: list[float] = []

    def _now(self, kinds: tuple[str, ...]) -> bool:
        return self.case.fault in kinds and self.step in self.mine

    def _second(self) -> int:
        """1 for the second fault of ``fault01`` (another element, other values: never the first's twin)."""
        return int(self.case.variant == "fault01" and self.step != self.case.fault_step)

    @torch.no_grad()
    def at_start(self, step: int) -> None:
        self.step = step
        if not self._now(("flip", "write")):
            return
        p = named(self.model, self.case.target)
        second = self._second()
        if self.case.fault == "flip":
            flip_bit(p, self.case.element + 7 * second, self.case.bit)
        else:  # a software write of the whole tensor: new values everywhere
            p.copy_(torch.linspace(-0.2, 0.2 + 0.1 * second, p.numel()).view_as(p))
        self.planted.append(step)

    def attach(self, opt: torch.optim.Optimizer) -> list[Any]:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def grad(o: Any, *_: Any) -> None:  # a global hook: before the library's (the gradient audit's)
            if o is opt and self._now(("grad",)) and self.step not in self.planted:
                g = named(self.model, self.case.target).grad
                if g is not None:
                    i = (self.case.element + 7 * self._second()) % g.numel()
                    g.view(-1)[i] = g.view(-1)[i] * (1 + 2**-10) + 2**-20  # after the all-reduce, on one rank
                    self.planted.append(self.step)

        return [register_optimizer_step_pre_hook(grad), opt.register_step_pre_hook(self._pre),
                opt.register_step_post_hook(self._post)]  # fmt: skip

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._now(("lr",)):
            self._lr = [g["lr"] for g in opt.param_groups]
            opt.param_groups[0]["lr"] = self._lr[0] * 10
            self.planted.append(self.step)

    @torch.no_grad()
    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._now(("lr",)) and self._lr:
            for g, lr in zip(opt.param_groups, self._lr):
                g["lr"] = lr
            self._lr = []
        if self._now(("compute",)) and self.step not in self.planted:  # inside the update, once (LBFGS steps twice)
            w = named(self.model, self.case.target).view(-1)
            i = (self.case.element + 7 * self._second()) % w.numel()
            w[i] = w[i] * (1 + 2**-10) + 2**-20  # a compute fault: lasts (a one-ulp one may round away)
            self.planted.append(self.step)
