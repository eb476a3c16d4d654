"""Replica discovery: for every audited tensor, which ranks hold a replica of it, decided from the engine.

One adapter per engine fills the same table, :class:`~weightsync_audit.engine.inventory.peers.Rules`:

========================  ===============================================================================
DDP, plain replicas       nothing to fill: every tensor is compared on every rank (the cached fast path)
DTensor (FSDP2, HSDP, TP)  the tensor's own peers (:mod:`~weightsync_audit.engine.inventory.peers`)
DeepSpeed ZeRO 0-3        :func:`deepspeed_rules` (below)
FSDP1                     :func:`fsdp1_rules` (below)
pipeline stages, experts  :mod:`.layouts` (:func:`declare_replicas`)
Megatron-core             :mod:`.layouts` (its ``parallel_state`` groups, its parameters' attributes)
========================  ===============================================================================

The table is resolved once per manifest build (:func:`replica_rules`: each engine asked once, over the
model's parameters named once) and written onto the manifest's entries (:func:`apply_rules`): a parameter's
gradient and its optimizer state of the parameter's own shape follow the parameter (an FSDP1 shard's
``exp_avg`` is a shard too), scalar state (``step``) follows the default.

A tensor with replicas is compared among their holders; a tensor with one owner is never compared and
never counted in ``checked``: the record says, in one note, how many there were and of which kinds
(:func:`~weightsync_audit.engine.agreement.rounds.sharded_notes`). Every decision reads the engine's own state, which is the same kind of state
on every rank, so every rank builds the same structure and takes the same path.

The sharding engines whose own state says which of a rank's tensors are replicas: DeepSpeed ZeRO and FSDP1.

**DeepSpeed ZeRO 0-3** (:func:`deepspeed_rules`).

- Module parameters: replicas under ZeRO 0-2 (the compute-dtype copies every rank all-gathers); under
  ZeRO-3 a parameter between steps is a ``Tensor(0,)`` placeholder (``ds_status`` NOT_AVAILABLE) and
  is *unreplicated* (its partition ``ds_tensor`` has one owner), while a gathered or persistent one
  (``ds_persist``, under ``stage3_param_persistence_threshold``) is a replica. No ZeRO-3 parameter is
  ever gathered for the audit: that would cost the whole model on every rank and compare nothing.
- Buffers: replicas (DeepSpeed broadcasts them at initialisation only, so they are compared).
- The inner optimizer: under ZeRO 1-3 (``BF16_Optimizer`` included) its parameters are this rank's fp32
  master partitions, so they and their ``exp_avg``/``exp_avg_sq`` have one owner; its ``step`` and its
  param groups' hyper-parameters are replicas. Under ZeRO-0 in bf16 (``FP16_UnfusedOptimizer``) every rank
  holds the whole fp32 master and its state: all replicas, all compared.
- ZeRO 0-2 (fp32 master beside the compute copies): a local check that the parameters this rank's master
  updates equal its cast, entered as one boolean entry (``zero.fp32_master_matches_params``) that every
  rank compares. A corrupted master partition is otherwise invisible until the next all-gather hands it
  to every rank.

**FSDP1** (``FullyShardedDataParallel``, :func:`fsdp1_rules`).

- ``NO_SHARD``: every parameter is a full replica (as under DDP).
- ``FULL_SHARD`` / ``SHARD_GRAD_OP``: each rank holds its own shard of every ``FlatParameter`` (equal
  padded pieces with ``use_orig_params=False``; uneven 1-D views of the original parameters with
  ``True``): *unreplicated*. Buffers and scalars (``step``, hyper-parameters) are compared.
- ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: a shard is replicated across the replicate group
  (``_inter_node_pg``), so it is compared among that group's ranks automatically, named by the shard
  index (``{"shard": i}``); no ``group=`` needed.

Optimizer state of a shard has one owner (its scalars, ``step``, are compared where they exist), so a
rank that lost it (a fresh optimizer, a failed load) would compare nothing: every rank that holds a
non-empty piece of a sharded parameter adds one boolean, ``fsdp1.optimizer_state_held.<name>``, whether
its optimizer holds state for it, compared among those ranks (a rank whose piece is empty holds no state
by design and no such entry).

Names drop FSDP's ``_fsdp_wrapped_module.`` prefixes, so they are the user's own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from weightsync_audit.compat_engines import (
    MASTER_CHECK,
    STATE_CHECK,
    deepspeed_engine_of,
    fp32_master_matches,
    fsdp1_flat_param,
    fsdp1_modules,
    fsdp1_orig_params,
    fsdp1_orig_shapes,
    fsdp1_replicate_ranks,
    fsdp1_strategy,
    zero3_param_status,
    zero_stage,
)
from weightsync_audit.engine.inventory.layouts import (
    Rules,
    declare_replicas,
    declared_rules,
    megatron_rules,
    stage_module,
)
from weightsync_audit.engine.inventory.manifest import (
    Entry,
    Manifest,
    build_manifest,
    named_tensors,
    remember_wrapper,
    unwrap_module,
    unwrap_optimizer,
    wrapper_of,
)
from weightsync_audit.engine.inventory.peers import ShardInfo, alone, among, in_stage

__all__ = [
    "MASTER_CHECK",
    "WRAPPED_PREFIX",
    "Rules",
    "apply_rules",
    "declare_replicas",
    "deepspeed_rules",
    "detect_engine",
    "fsdp1_rules",
    "remember_wrapper",
    "reducing_engine",
    "replica_manifest",
    "replica_rules",
    "stage_module",
]


def replica_rules(
    module: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    include: Sequence[str],
    built: Manifest,
) -> tuple[Rules, list[str], list[str]]:
    """The table, the engines that reduce the gradients themselves (DeepSpeed, FSDP1), and every engine:
    the model unwrapped and its parameters named once (by ``built``'s build), each engine asked once."""
    user, named = built.walked
    rules = Rules(params_by_name=dict(named))
    names = [e.name for e in built.entries]
    reducing = [
        deepspeed_rules(rules, user, optimizers, include, module),
        fsdp1_rules(rules, user, names, optimizers, include),
    ]
    megatron = megatron_rules(rules, module, user, optimizers, include)
    engines = [*reducing, megatron or declared_rules(rules, module, user)]
    return rules, [e for e in reducing if e], [e for e in engines if e]


def _engines(module: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer]) -> tuple[list[str], list[str]]:
    """The engines that reduce the gradients themselves, and every engine (no entries: names not read)."""
    user = unwrap_module(module) if module is not None else None
    walked = (user, named_tensors(user) if user is not None else [])
    return replica_rules(module, [unwrap_optimizer(o) for o in optimizers], (), Manifest(walked=walked))[1:]


def detect_engine(module: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer] = ()) -> list[str]:
    """The engines that hold ``module``'s tensors, e.g. ``["DeepSpeed ZeRO-2"]`` (empty: plain replicas).
    ``optimizers`` as the audit takes them (``engine.optimizer`` included)."""
    return _engines(module, optimizers)[1]


def reducing_engine(module: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer] = ()) -> str | None:
    """The engine that reduces ``module``'s gradients itself (DeepSpeed, FSDP1), ``None`` for DDP's or
    plain replicas, and for a declared layout (pipeline stages, expert groups), which reduces nothing."""
    return ", ".join(_engines(module, optimizers)[0]) or None


def replica_manifest(
    module: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    include: Sequence[str] = ("params", "buffers", "optimizer"),
    **settings: Any,
) -> Manifest:
    """The manifest of ``include`` with every entry's replica rule: what an audit compares and a resync copies
    (a plain model's is left as built).

    ``settings``: the rest of :func:`~weightsync_audit.engine.inventory.manifest.build_manifest`'s (exclude,
    skipped buffers), which leave entries out and change none of those kept."""
    manifest = build_manifest(module, optimizers, include=include, **settings)
    rules = replica_rules(module, optimizers, include, manifest)[0]
    if not rules.empty:
        apply_rules(manifest, optimizers, rules)
    return manifest


_SCALAR_OF_SHARD = among("scalar state of a sharded parameter", (), {}, (-1,))
"""``step`` of a parameter held in pieces: a replica wherever it exists, but a rank whose piece is empty
(FSDP1 ``use_orig_params=True``) has no state for it, and that is no structure difference."""


def apply_rules(manifest: Manifest, optimizers: Sequence[torch.optim.Optimizer], rules: Rules) -> None:
    """Write ``rules`` onto ``manifest``'s entries (in place)."""
    params = rules.params_by_name
    owner: dict[int, Any] = {}
    for opt in optimizers:
        for p, state in opt.state.items():
            owner[id(state)] = p
    kept: list[Entry] = []
    for e in manifest.entries:
        kept.append(e)
        if e.shard is not None:  # a DTensor keeps its own peers, within its declared stage
            if rules.stage is not None:
                e.shard = in_stage(e.shard, rules.stage)
            continue
        info: ShardInfo | None = rules.default
        p = None
        if e.kind in ("param", "grad"):
            p = params.get(e.name)
        elif e.kind == "optimizer" and id(e.container) in owner:
            p = owner[id(e.container)]
        if e.kind == "buffer" and rules.buffers is not None:
            info = rules.buffers
        if rules.by_name is not None:
            base = e.name if e.kind != "optimizer" or p is None else e.name.rsplit(".", 1)[0]
            info = rules.by_name(base) or info
        if p is not None and id(p) in rules.params:
            if e.kind == "grad" and e.dtype == "none" and p.numel() == 0:
                kept.pop()  # an empty local piece (FSDP1 use_orig_params=True) has no gradient: nothing held
                continue
            # A state tensor of its parameter's local shape is held the way the parameter is; others are scalars.
            t = e.tensor
            same = isinstance(t, torch.Tensor) and t.dim() > 0 and tuple(t.shape) == tuple(p.shape)
            info = rules.params[id(p)] if e.kind != "optimizer" or same else _SCALAR_OF_SHARD
        if info is not None:
            if e.kind == "grad" and e.dtype == "none":
                info = replace(info, shape=())
            e.shard, e.shape = info, info.shape if info.shape != (-1,) else e.shape
    manifest.entries[:] = kept
    manifest.entries.extend(rules.extra)
    for e in manifest.entries:
        for s in rules.strip:
            if s in e.name:
                e.name = e.name.replace(s, "")
        if rules.prefix:
            e.name = rules.prefix + e.name


def deepspeed_rules(
    rules: Rules,
    user: nn.Module | None,
    optimizers: Sequence[torch.optim.Optimizer],
    include: Sequence[str],
    module: nn.Module | None = None,
) -> str | None:
    """Fill ``rules`` for a DeepSpeed-trained model; return the engine's name (``"DeepSpeed ZeRO-2"``) or
    ``None`` when nothing here is DeepSpeed's.

    ``optimizers`` may hold ``engine.optimizer`` (unwrapped to its torch optimizer, the wrapper
    remembered) or the torch optimizer the user passed to ``deepspeed.initialize``: the engine is then
    found from ``module`` (the engine, or the model it trains) and its wrapper remembered alike."""
    found: str | None = None
    if any(wrapper_of(opt) is None for opt in optimizers):
        engine = next((e for m in (module, user) if (e := deepspeed_engine_of(m)) is not None), None)
        if engine is not None and getattr(engine, "optimizer", None) is not None:
            unwrap_optimizer(engine.optimizer)  # remembers the ZeRO wrapper of the torch optimizer inside it
    # ZeRO-3 converts every parameter of the model it holds: the first one tells, at no per-parameter cost.
    params = list(rules.params_by_name.values())
    stages = [zero_stage(wrapper_of(opt)) for opt in optimizers]
    if (not params or zero3_param_status(params[0]) is None) and all(s is None for s in stages):
        return None  # not DeepSpeed's: no walk over the parameters
    for p in params:
        status = zero3_param_status(p)
        if status is None:
            continue
        found = "DeepSpeed ZeRO-3"
        if status[0] == "placeholder":
            rules.params[id(p)] = alone("ZeRO-3 partitioned parameter", status[1])
    module_params = {id(p) for p in params}
    for opt, stage in zip(optimizers, stages):
        if stage is None:
            continue
        found = f"DeepSpeed ZeRO-{stage}" if stage else "DeepSpeed (bf16/fp16)"
        for group in opt.param_groups if stage else ():  # ZeRO-0: a whole fp32 master on every rank, compared
            for p in group["params"]:
                if id(p) not in module_params:  # an fp32 master partition, not a module parameter
                    rules.params[id(p)] = alone("ZeRO optimizer partition", tuple(p.shape))
        if stage in (0, 1, 2) and "optimizer" in include:
            ok = fp32_master_matches(wrapper_of(opt))
            if ok is not None:
                t = torch.tensor(bool(ok))
                rules.extra.append(Entry(MASTER_CHECK, "optimizer", t, "bool", ()))
    return found


WRAPPED_PREFIX = "_fsdp_wrapped_module."


def fsdp1_rules(
    rules: Rules,
    root: nn.Module | None,
    names: Sequence[str] = (),
    optimizers: Sequence[torch.optim.Optimizer] = (),
    include: Sequence[str] = (),
) -> str | None:
    """Fill ``rules`` for every FSDP1 instance under ``root``; return ``"FSDP1 <strategy>"`` or ``None``.

    ``names`` (the manifest's): FSDP1 puts ``_fsdp_wrapped_module.`` in every name it holds, so a model
    without it is not walked at all. With ``"optimizer"`` in ``include``, the state checks of ``optimizers``
    are added (see the module docstring)."""
    if root is None or (names and not any(WRAPPED_PREFIX in n for n in names)):
        return None
    found = None
    for _, fsdp in fsdp1_modules(root):
        strategy = fsdp1_strategy(fsdp)
        found = found or f"FSDP1 {strategy}"
        flat = fsdp1_flat_param(fsdp)
        if flat is None or strategy == "NO_SHARD":
            continue
        shapes = fsdp1_orig_shapes(flat)
        held = [(flat, (-1,))] + [
            (p, tuple(shapes[i]) if i < len(shapes) else (-1,)) for i, p in enumerate(fsdp1_orig_params(flat))
        ]
        replicate = fsdp1_replicate_ranks(fsdp) if "HYBRID" in strategy else None
        hybrid = replicate is not None and len(replicate) > 1
        shard = dist.get_rank(getattr(fsdp, "process_group", None)) if hybrid else 0
        for p, shape in held:
            # A flat parameter's shard has the same padded size on every rank of its sharding group; an
            # original parameter's view does not, so it is described by its unsharded shape.
            full = tuple(int(s) for s in (p.shape if shape == (-1,) else shape))
            rules.params[id(p)] = (
                among("FSDP1 hybrid shard", replicate or (), {"shard": shard}, full)
                if hybrid
                else alone("FSDP1 shard", full)
            )
    if found:
        rules.strip = (*rules.strip, WRAPPED_PREFIX)
    if found and "optimizer" in include:
        _state_checks(rules, optimizers)
    return found


_HELD = among("FSDP1 optimizer state held", (), {}, ())
"""Compared among the ranks that hold the check (those with a non-empty piece of the parameter)."""


def _state_checks(rules: Rules, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """One ``fsdp1.optimizer_state_held.<name>`` per sharded parameter of ``optimizers`` with a non-empty piece
    here, named as the manifest names the parameter's state."""
    names = {id(p): n for n, p in rules.params_by_name.items()}
    multi = len(optimizers) > 1
    for oi, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in rules.params or p.numel() == 0:
                    continue
                name = names.get(id(p)) or f"{f'optimizers.{oi}.' if multi else ''}param_groups.{gi}.params.{pi}"
                held = torch.tensor(bool(opt.state.get(p)))
                rules.extra.append(Entry(f"{STATE_CHECK}.{name}", "optimizer", held, "bool", (), shard=_HELD))
