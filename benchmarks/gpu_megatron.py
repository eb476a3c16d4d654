"""Megatron-core end to end on a GPU: its GPTModel under its DDP and distributed optimizer, then the audit.

    python benchmarks/gpu_megatron.py            # on a CUDA machine (one process, NCCL, about a minute)
    python benchmarks/gpu_megatron.py --dry-run  # the CPU part only: a real GPTModel on gloo, params audited

``run()`` returns rows ``[check, size, answer, figures]`` (``answer``: ``ok``, ``WRONG`` or ``skipped``), the
shape ``benchmarks/gpu_check.py`` prints. Megatron's DDP needs CUDA (its grad buffer asks
``torch.cuda.current_device()``), so without a device the end-to-end checks are ``skipped``. Checks:

- ``megatron gpt cpu layout``: a GPTModel (local layer spec, tensor-parallel layers) built on CPU is
  recognised by the audit, and a world of one audits it in sync (the dry run, and the first row on a GPU);
- ``megatron ddp + distributed optimizer``: two training steps under Megatron's DDP (contiguous grad buffer,
  ``main_grad``) and its distributed optimizer (fp32 main-param shards), then ``audit(ddp_model, optimizer,
  include=params/buffers/optimizer/grads)``: in sync, the record's note names the distributed-optimizer
  shards as one-owner tensors, and the names are the model's own (no ``module.`` prefix);
- ``megatron check_param_hashes``: the audit's time beside Megatron's ``check_param_hashes_across_dp_replicas``
  on the same DDP model, in the same run.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
import torch
import torch.distributed as dist

Row = list[str]


def build_gpt(hidden: int = 64, layers: int = 2, vocab: int = 128, on_cpu: bool = True) -> Any:
    """A small Megatron GPTModel with the local (no Transformer Engine) layer spec; needs parallel_state."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        use_cpu_initialization=on_cpu,
        pipeline_dtype=torch.float32,
    )
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=32)


def _world_of_one(backend: str) -> None:
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _cpu_layout() -> Row:
    from megatron.core import parallel_state as ps

    from weightsync_audit import audit
    from weightsync_audit.engine.inventory.replicas import detect_engine

    ps.initialize_model_parallel()
    try:
        model = build_gpt()
        engines = detect_engine(model)
        result = audit(model, timeout_s=60)
        ok = result.in_sync and any(e.startswith("Megatron-core") for e in engines)
        return ["megatron gpt cpu layout", "world 1", "ok" if ok else "WRONG", f"engine {engines}"]
    finally:
        ps.destroy_model_parallel()


def _end_to_end(reps: int) -> list[Row]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import check_param_hashes_across_dp_replicas

    from weightsync_audit import audit
    from weightsync_audit.engine.inventory.layouts import MAIN_PARAM_SHARD

    torch.cuda.set_device(0)
    ps.initialize_model_parallel()
    rows: list[Row] = []
    try:
        gpt = build_gpt(hidden=1024, layers=8, vocab=32000, on_cpu=False).cuda()
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
        model = DistributedDataParallel(gpt.config, ddp_config, gpt)
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True, bf16=False), [model]
        )
        tokens = torch.randint(0, 32000, (2, 32), device="cuda")
        position_ids = torch.arange(32, device="cuda").expand(2, 32)
        for _ in range(2):
            model.zero_grad_buffer()
            opt.zero_grad()
            loss = model(tokens, position_ids, None, labels=tokens).float().mean()
            loss.backward()
            model.finish_grad_sync()
            opt.step()
        torch.cuda.synchronize()
        result = audit(model, opt, include=("params", "buffers", "optimizer", "grads"), timeout_s=120)
        record = result.to_dict()
        notes = " ".join(record.get("notes") or [])
        names = [m.name for m in result.mismatches]
        ok = result.in_sync and MAIN_PARAM_SHARD in notes and not any(n.startswith("module.") for n in names)
        rows.append(["megatron ddp + distributed optimizer", "8 layers h1024", "ok" if ok else "WRONG", notes[:160]])
        t_audit = []
        t_megatron = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            audit(model, include=("params",), timeout_s=120)
            t_audit.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            same = check_param_hashes_across_dp_replicas([model], cross_check=True)
            torch.cuda.synchronize()
            t_megatron.append(time.perf_counter() - t0)
        a, m = sorted(t_audit)[reps // 2], sorted(t_megatron)[reps // 2]
        rows.append(
            [
                "megatron check_param_hashes",
                "8 layers h1024",
                "ok" if same else "WRONG",
                f"audit {a * 1e3:.1f} ms, megatron {m * 1e3:.1f} ms ({m / a:.1f}x)",
            ]
        )
    finally:
        ps.destroy_model_parallel()
    return rows


def run(dry_run: bool = False, reps: int = 5) -> list[Row]:
    """Every check as rows; end-to-end ones ``skipped`` without CUDA or with ``dry_run``."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return [["megatron", "-", "skipped", "megatron-core is not installed"]]
    gpu = torch.cuda.is_available() and not dry_run
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    _world_of_one("nccl" if gpu else "gloo")
    rows = [_cpu_layout()]
    if gpu:
        rows += _end_to_end(reps)
    else:
        rows += [
            ["megatron ddp + distributed optimizer", "-", "skipped", "needs CUDA"],
            ["megatron check_param_hashes", "-", "skipped", "needs CUDA"],
        ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rows = run(args.dry_run, args.reps)
    print(harness.machine())
    print(harness.table(["check", "size", "answer", "figures"], rows))
    sys.exit(1 if any(r[2] == "WRONG" for r in rows) else 0)


if __name__ == "__main__":
    main()
