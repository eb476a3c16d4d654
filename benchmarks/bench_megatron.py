"""The audit beside Megatron-core's own ``check_param_hashes_across_dp_replicas``, on CPU gloo ranks.

Megatron's check (``megatron.core.utils``, as installed) hashes each parameter with SHA-1 over a CPU fp32
copy, all-gathers the hashes over the data-parallel group (the expert-data-parallel group for experts)
and compares each rank with data-parallel replica 0. It calls ``.cuda()`` on the stacked 20-byte hashes
before the all-gather; on CPU gloo that call is made the identity for the duration of the call (the
stack is ``20 x tensors`` bytes: nothing else of the function changes). The audit runs world-wide with
no ``group=``: it reads the same layout from ``parallel_state`` and also compares the tensor-parallel
duplicates (LayerNorms, row-parallel biases) across tensor-parallel ranks, which Megatron's check
does not.

    python benchmarks/bench_megatron.py --model 10M --tp 2 --reps 5

Each rank holds a GPT-shaped model laid out as Megatron lays it out on ``tp`` ranks (qkv/fc1 split by
column, proj/fc2 by row, marked ``tensor_model_parallel``), and the slowest rank's time of each call
counts (see ``harness.timed``).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any, Iterator

import harness
import torch
from models import SPECS, build, nbytes

WORLD = 4


@contextlib.contextmanager
def _cuda_is_identity() -> Iterator[None]:
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda  # type: ignore[method-assign]


def _megatron_layout(model: torch.nn.Module, tp: int, tp_rank: int) -> torch.nn.Module:
    """Split qkv/fc1 by output rows and proj/fc2 by input columns over ``tp`` ranks, as Megatron holds them."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    with torch.no_grad():
        for block in model.blocks:
            for name, dim in (("qkv", 0), ("fc1", 0), ("proj", 1), ("fc2", 1)):
                lin = getattr(block, name)
                w = lin.weight.chunk(tp, dim=dim)[tp_rank].clone()
                lin.weight = torch.nn.Parameter(w)
                set_tensor_model_parallel_attributes(lin.weight, True, dim, 1)
                if dim == 0:
                    lin.bias = torch.nn.Parameter(lin.bias.chunk(tp)[tp_rank].clone())
                    set_tensor_model_parallel_attributes(lin.bias, True, 0, 1)
    return model


def _rank(rank: int, world: int, spec_key: str, tp: int, reps: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.utils import check_param_hashes_across_dp_replicas

    from weightsync_audit import Auditor

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = _megatron_layout(harness.own_copy(build(SPECS[spec_key])), tp, ps.get_tensor_model_parallel_rank())
    auditor = Auditor(model, include=("params",), timeout_s=600)

    def megatron() -> bool:
        with _cuda_is_identity():
            return check_param_hashes_across_dp_replicas([model], cross_check=True)

    results = {"megatron_ok": megatron(), "audit_ok": auditor.audit().in_sync}
    results["audit"] = harness.median(harness.timed(lambda: auditor.audit(), reps))
    results["megatron"] = harness.median(harness.timed(megatron, reps))
    results["bytes"] = nbytes(model)
    results["checked"] = auditor.audit().to_dict()["checked"]["param"]
    ps.destroy_model_parallel()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="10M", choices=sorted(SPECS))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import megatron.core.parallel_state  # noqa: F401 - imported once here, inherited by every forked rank

    t0 = time.time()
    out = harness.launch(_rank, WORLD, args.model, args.tp, args.reps)
    r = out[0]
    assert all(o["megatron_ok"] and o["audit_ok"] for o in out), out
    rows = [
        [
            SPECS[args.model].label,
            f"{WORLD} (tp={args.tp}, dp={WORLD // args.tp})",
            f"{r['bytes'] / 2**20:.1f}",
            f"{r['audit'] * 1e3:.1f}",
            f"{r['megatron'] * 1e3:.1f}",
            f"{r['megatron'] / r['audit']:.1f}x",
            str(r["checked"]),
        ]
    ]
    print(harness.machine())
    headers = ["model", "ranks", "MiB/rank", "audit ms", "megatron ms", "megatron/audit", "tensors audited"]
    print(harness.table(headers, rows))
    print(f"({time.time() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
