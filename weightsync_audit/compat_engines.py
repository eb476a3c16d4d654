"""Every private DeepSpeed and FSDP1 internal the library touches, in one place (beside compat.py).

The replica adapters (:mod:`weightsync_audit.engine.inventory.replicas`) ask these accessors which
engine holds a tensor and how; nothing else reads an engine's private attributes. DeepSpeed is
recognised by class names, so it is never imported here. Each accessor returns ``None`` (or a neutral
answer) when what it relies on is missing, and the adapter then treats the tensor as a plain replica
or as unreplicated, never guessing a peer it cannot name.

>>> import torch
>>> zero_stage(torch.optim.SGD([torch.zeros(1)], lr=0.1)) is None
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weightsync_audit.compat import class_names

__all__ = [
    "is_deepspeed_engine",
    "deepspeed_engine_of",
    "zero_stage",
    "zero3_param_status",
    "fp32_master_matches",
    "MASTER_CHECK",
    "STATE_CHECK",
    "fsdp1_modules",
    "fsdp1_flat_param",
    "fsdp1_orig_params",
    "fsdp1_orig_shapes",
    "fsdp1_replicate_ranks",
    "fsdp1_strategy",
    "pipeline_stage_index",
    "lightning_next_batch",
]


# -- DeepSpeed ---------------------------------------------------------------------------------


def is_deepspeed_engine(module: Any) -> bool:
    """Whether ``module`` is a ``deepspeed.DeepSpeedEngine`` (its ``.module`` is the user's model)."""
    return "DeepSpeedEngine" in class_names(module) and isinstance(getattr(module, "module", None), nn.Module)


def deepspeed_engine_of(module: Any) -> Any:
    """The ``DeepSpeedEngine`` training ``module``: ``module`` itself, or the engine whose forward hooks
    ``deepspeed.initialize`` registered on the user's model (closures over the engine, read from the
    module's ``_forward_pre_hooks`` / ``_forward_hooks``); ``None`` when neither is found. Lets an audit
    given the torch optimizer passed to ``deepspeed.initialize`` (not ``engine.optimizer``) find the ZeRO
    wrapper around it."""
    if module is None:
        return None
    if is_deepspeed_engine(module):
        return module
    for hooks in (getattr(module, "_forward_pre_hooks", None), getattr(module, "_forward_hooks", None)):
        for hook in list(hooks.values()) if isinstance(hooks, dict) else ():
            for cell in getattr(hook, "__closure__", None) or ():
                try:
                    held = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if is_deepspeed_engine(held) and held.module is module:
                    return held
    return None


def zero_stage(optimizer: Any) -> int | None:
    """The ZeRO stage of a DeepSpeed optimizer wrapper: 1 or 2 (``DeepSpeedZeroOptimizer``, whose
    ``partition_gradients`` tells them apart), 3 (``DeepSpeedZeroOptimizer_Stage3``), 1 for
    ``BF16_Optimizer`` (it partitions its fp32 master as ZeRO-1 does: DeepSpeed picks it for ZeRO-1 in bf16
    with fp32 gradient accumulation), 0 for the bf16/fp16 wrappers that keep a whole fp32 master on every
    rank without ZeRO (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``); ``None`` for anything else."""
    names = class_names(optimizer)
    if "DeepSpeedZeroOptimizer_Stage3" in names:
        return 3
    if "DeepSpeedZeroOptimizer" in names:
        return 2 if getattr(optimizer, "partition_gradients", False) else 1
    if "BF16_Optimizer" in names:
        return 1
    if names & {"FP16_Optimizer", "FP16_UnfusedOptimizer"}:
        return 0
    return None


def zero3_param_status(p: Any) -> tuple[str, tuple[int, ...]] | None:
    """For a ZeRO-3 parameter: ``("placeholder" | "gathered" | "persistent", full shape)``; ``None`` for a
    parameter ZeRO-3 does not manage. Reads ``ds_status``, ``ds_persist`` and ``ds_shape``."""
    status = getattr(p, "ds_status", None)
    if status is None:
        return None
    shape = tuple(int(s) for s in getattr(p, "ds_shape", p.shape))
    if getattr(status, "name", str(status)) != "AVAILABLE":
        return "placeholder", shape
    return ("persistent" if getattr(p, "ds_persist", False) else "gathered"), shape


def _master_pairs(optimizer: Any) -> list[tuple[Any, Any]] | None:
    """(fp32 master, the compute-dtype tensor it is cast into) for every group this rank updates."""
    names = class_names(optimizer)
    if "DeepSpeedZeroOptimizer" in names:  # ZeRO-1/2: this rank's partition of the flat bit16 group
        bit16, masters = optimizer.parallel_partitioned_bit16_groups, optimizer.single_partition_of_fp32_groups
    elif "BF16_Optimizer" in names:  # the same, under other names
        bit16, masters = optimizer.bf16_partitioned_groups, optimizer.fp32_groups_flat_partition
    elif "FP16_UnfusedOptimizer" in names:  # no ZeRO: one whole fp32 master per parameter
        return [(m, p) for ms, ps in zip(optimizer.fp32_groups, optimizer.fp16_groups) for m, p in zip(ms, ps)]
    else:
        return None
    groups = optimizer.real_dp_process_group
    return [(master, bit16[i][dist.get_rank(group=groups[i])]) for i, master in enumerate(masters)]


MASTER_CHECK = "zero.fp32_master_matches_params"
"""The name :func:`fp32_master_matches`'s answer is audited under (a check drawn from the parameters, not a
tensor of the model): kept here, at the bottom, for the replica adapter, the hints and the resync plan."""


STATE_CHECK = "fsdp1.optimizer_state_held"
"""Prefix of the names (``fsdp1.optimizer_state_held.<parameter>``) under which each rank holding a non-empty
piece of an FSDP1-sharded parameter says whether its optimizer holds state for it: the state itself has no
replica, so a rank that lost it would otherwise go unseen. A check, never copied by a resync."""


def fp32_master_matches(optimizer: Any) -> bool | None:
    """Whether the compute-dtype parameters this rank's fp32 master updates equal the cast of that master:
    ZeRO-1/2 (``DeepSpeedZeroOptimizer``, ``BF16_Optimizer``: this rank's slice of the flat parameters and
    its own master partition) and ZeRO-0 in bf16 (``FP16_UnfusedOptimizer``: every parameter and its whole
    master). ``None`` when these are missing or offloaded, or for the fused ``FP16_Optimizer``."""
    try:
        pairs = _master_pairs(optimizer)
        if pairs is None:
            return None
        for master, mine in pairs:
            if master.device != mine.device or master.numel() != mine.numel():
                return None
            if not torch.equal(master.detach().to(mine.dtype).view(-1), mine.detach().reshape(-1)):
                return False
        return True
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None


# -- FSDP1 -------------------------------------------------------------------------------------


def fsdp1_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every FSDP1 ``FullyShardedDataParallel`` instance in ``root`` (itself included), with its name."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover - torch without FSDP
        return []
    return [(n, m) for n, m in root.named_modules() if isinstance(m, FSDP)]


def fsdp1_flat_param(fsdp: nn.Module) -> Any:
    """The FSDP1 instance's ``FlatParameter`` (``_flat_param``), or ``None``; its ``_params`` (with
    ``use_orig_params=True``) are the original parameters, views into it."""
    return getattr(fsdp, "_flat_param", None)


def fsdp1_orig_params(flat: Any) -> list[Any]:
    """The original parameters of a ``FlatParameter`` (``_params``; empty without ``use_orig_params``)."""
    return list(getattr(flat, "_params", None) or [])


def fsdp1_orig_shapes(flat: Any) -> list[tuple[int, ...]]:
    """The unsharded shapes of a ``FlatParameter``'s original parameters (``_shapes``), in order."""
    return [tuple(int(d) for d in s) for s in (getattr(flat, "_shapes", None) or [])]


def fsdp1_strategy(fsdp: nn.Module) -> str:
    """The sharding strategy's name: ``FULL_SHARD``, ``SHARD_GRAD_OP``, ``NO_SHARD``, ``HYBRID_SHARD``,
    ``_HYBRID_SHARD_ZERO2``."""
    return str(getattr(getattr(fsdp, "sharding_strategy", None), "name", "FULL_SHARD"))


def fsdp1_replicate_ranks(fsdp: nn.Module) -> tuple[int, ...] | None:
    """HYBRID_SHARD: the global ranks of this rank's replicate group (``_inter_node_pg``), else ``None``."""
    pg = getattr(fsdp, "_inter_node_pg", None)
    if pg is None:
        return None
    return tuple(sorted(dist.get_process_group_ranks(pg)))


def pipeline_stage_index(stage: Any) -> int | None:
    """The index of a ``torch.distributed.pipelining`` stage (``stage_index``), or ``None``."""
    index = getattr(stage, "stage_index", None)
    return int(index) if isinstance(index, int) else None


def pipeline_stage_of(obj: Any) -> tuple[nn.Module, int, int] | None:
    """``(stage module, stage index, number of stages)`` of a ``torch.distributed.pipelining`` stage
    (``PipelineStage``) or of a single-stage schedule (``ScheduleGPipe``, ``Schedule1F1B``... keep theirs in
    ``_stage``), else ``None``. A schedule of several stages on one rank raises ``TypeError``."""
    if isinstance(getattr(obj, "_stages", None), list) and len(obj._stages) > 1:
        raise TypeError(
            f"{type(obj).__name__} runs {len(obj._stages)} stages on this rank: audit each stage's module, "
            "declared with declare_replicas(stage.submod, stage=stage, stage_group=...)"
        )
    stage = getattr(obj, "_stage", None) or (obj._stages[0] if getattr(obj, "_stages", None) else obj)
    submod, index, n = getattr(stage, "submod", None), pipeline_stage_index(stage), getattr(stage, "num_stages", None)
    if isinstance(submod, nn.Module) and index is not None and isinstance(n, int):
        return submod, index, n
    return None


def mesh_pipeline_coordinate(mesh: Any, dim: str = "pp") -> int | None:
    """This rank's coordinate on the ``pp`` dimension of the mesh that ``mesh`` was sliced from, when
    ``mesh`` itself lacks it (a stage's ``dp`` submesh of a ``(pp, dp)`` mesh), else ``None``."""
    root_of = getattr(mesh, "_get_root_mesh", None)
    root = root_of() if callable(root_of) else None
    if root is None or root is mesh:
        return None
    names, own = tuple(root.mesh_dim_names or ()), tuple(mesh.mesh_dim_names or ())
    if dim not in names or dim in own:
        return None
    coord = root.get_coordinate()
    return None if coord is None else int(coord[names.index(dim)])


# -- Lightning's fit loop ------------------------------------------------------------------------


def _stateful_loaders(loop: Any) -> bool:
    """Whether every training loader can give its place back (``state_dict``/``load_state_dict``, Lightning's
    ``_Stateful``): Lightning restores only those mid-epoch (``fit_loop._combined_loader``)."""
    combined = getattr(loop, "_combined_loader", None)
    loaders = list(getattr(combined, "flattened", None) or [])
    return bool(loaders) and all(
        callable(getattr(dl, "state_dict", None)) and callable(getattr(dl, "load_state_dict", None)) for dl in loaders
    )


def lightning_next_batch(trainer: Any, resumed: bool) -> tuple[int, int, str | None] | None:
    """The next batch a Lightning ``Trainer`` trains, as ``(epoch, batch, cause)``: the epoch it is trained in
    and its index in that epoch's pass over the data; ``cause`` says why a resume is not where it was saved.
    ``None`` when the fit loop's counters are not there (another Lightning).

    From the fit loop's progress (``epoch_progress``, ``epoch_loop.batch_progress``), as Lightning saves it
    and restores it. At a save: after an epoch's last batch, the next epoch's first batch; mid-epoch, the
    epoch's next batch. Right after a restore (``on_train_start``, ``resumed``), what Lightning will train:
    a new epoch at its first batch, or, restarted inside an epoch (``restarted_mid_epoch``, or an iteration
    based run, ``max_steps``, saved at an epoch's end: ``restarted_on_epoch_end``), the epoch Lightning counts
    on in, at the batch it counts on from when every loader is stateful, else at the data's first batch
    (Lightning cannot restore a plain ``DataLoader``'s place: it starts its data over).
    """
    loop = getattr(trainer, "fit_loop", None)
    try:
        epochs = loop.epoch_progress.current  # type: ignore[union-attr]
        epoch_loop = loop.epoch_loop  # type: ignore[union-attr]
        batches = epoch_loop.batch_progress
    except AttributeError:
        return None
    if not resumed:
        if epochs.processed == epochs.started or batches.is_last_batch:  # the epoch's batches are done
            return epochs.processed + (epochs.processed < epochs.started), 0, None
        return epochs.processed, batches.current.processed, None
    inside = bool(getattr(loop, "restarted_mid_epoch", False) or getattr(loop, "restarted_on_epoch_end", False))
    if not inside:
        return epochs.processed, 0, None
    at_end = bool(getattr(epoch_loop, "restarted_on_train_batch_end", False))
    done = batches.current.completed + int(at_end)
    if at_end and done >= trainer.num_training_batches:  # saved after the epoch's last batch: the next epoch
        return epochs.processed, 0, None
    epoch = int(trainer.current_epoch)
    if getattr(loop, "restarted_on_epoch_end", False):
        cause = (
            f"Lightning resumes an iteration-based run (max_steps) saved at the end of epoch {epoch} inside that "
            "epoch: it trains one batch more there and counts its epochs on from that, so the batches that follow "
            "are not the uninterrupted run's"
        )
        return epoch, 0, cause
    if _stateful_loaders(loop):
        return epoch, done, None
    cause = (
        f"Lightning cannot restore a DataLoader without state_dict() mid-epoch: it starts epoch {epoch}'s data over "
        f"while counting on from batch {done}, so every rank trains that epoch's first {done} batches again "
        "(resume from an end-of-epoch checkpoint, or give the loader state_dict() and load_state_dict())"
    )
    return epoch, 0, cause
