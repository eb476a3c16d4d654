"""Campaign rows for sharded runs: FSDP2 (2 ranks), HSDP (4 ranks) and FSDP2 + tensor parallel (4 ranks) with
``attribution=True`` and ``on_mismatch="resync"``, healthy and with one bit flipped in one rank's local shard.

    python benchmarks/campaign_mesh.py --runs 2 --seed 0

Each run is a ``LoopAudit`` over a tiny model from ``tests/mesh_models.py`` on forked CPU gloo ranks, Adam,
an audit every step. A faulty run flips one bit (behind torch's back) of the local shard of a tensor another
rank holds too, at rest (in a global optimizer pre-step hook registered before the library's: after the
backward, so that no collective spreads it, and before the update): FSDP2's BatchNorm buffer (no shard has a replica), an HSDP shard (its replica across the
``replicate`` dimension), a tensor sharded over ``dp`` only under TP (its replica across ``tp``).

The truth owes nothing to the library: every rank copies the bytes of its local shard of every parameter,
buffer and optimizer state right before the audit call (``E``) and right after it (``X``). The ranks holding
the same shard are found from torch's own ``DTensor`` placements and mesh coordinates (the coordinates of the
mesh dimensions the tensor is sharded over); the parent compares their bytes with ``torch.equal``. Columns,
each a count of runs: *false alarm* (a divergent record while every shard equals its replicas at ``E``, or a
mismatch naming a tensor that does not differ), *fault not named* (a shard differing at ``E`` and the record in
sync or naming none of them), *false blame* (``blame.ranks`` names a rank holding the healthy bytes), *repair
from a corrupted source* (at ``X`` the replicas equal the flipped rank's bytes of ``E``), *healthy machine
named* (``evict_targets`` of the record under ``exit_code`` names a rank that holds the healthy bytes),
*crash*, *hang*; and, as information: *repaired* (at ``X`` the replicas equal the healthy bytes) and *tie
repair* (2 replicas of a buffer, no rank blamed: attribution keeps no at-rest record of buffers, which every
forward writes, so the resync takes ``resync_src`` and says it was chosen without evidence; a repair from the
flipped side is counted here, not as a failure, as the combination campaign counts a tie without evidence).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))

from harness import launch, table  # puts tests/ on the path

STEPS = 4
KINDS = {"fsdp2": 2, "hsdp": 4, "tp": 4}
"""Each mesh and its world size."""
TARGETS = {
    "fsdp2": ("bn.running_mean",),  # pure FSDP2: no shard has a replica, the buffer has
    "hsdp": ("fc1.weight", "fc1.bias", "fc2.weight"),  # replicated across ``replicate``
    "tp": ("dp1.weight", "dp1.bias", "ln.weight"),  # sharded over dp only: replicated across tp
}
COLUMNS = ("false alarm", "fault not named", "false blame", "repair from corrupted", "healthy machine named",
           "crash", "hang")  # fmt: skip


def draw(kind: str, n: int, seed: int) -> dict[str, Any] | None:
    """Run ``n`` of ``kind``: even runs healthy, odd runs a flip on a drawn rank, tensor, step, element, bit."""
    if n % 2 == 0:
        return None
    rng = random.Random(f"{seed}-mesh-{kind}-{n}")
    return {"rank": rng.randrange(KINDS[kind]), "target": rng.choice(TARGETS[kind]), "step": rng.randint(2, 3),
            "element": rng.randrange(64), "bit": rng.randint(20, 27)}  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _shard_key(t: Any) -> tuple[Any, ...]:
    """Which shard this rank holds: its coordinates on the mesh dimensions ``t`` is sharded over (torch's own
    placements; ``()`` for a plain tensor, the same on every rank)."""
    if not hasattr(t, "placements"):
        return ()
    coord = t.device_mesh.get_coordinate()
    return tuple((i, coord[i]) for i, pl in enumerate(t.placements) if not pl.is_replicate())


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = {}
    for n, p in model.named_parameters():
        names[id(p)] = n
        out[n] = p
    out.update(dict(model.named_buffers()))
    for p, state in opt.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                out[f"{names[id(p)]}.{k}"] = v
    return out


def _snap(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {n: _local(t).detach().contiguous().reshape(-1).view(torch.uint8).clone() for n, t in
            _tensors(model, opt).items()}  # fmt: skip


def run_mesh(rank: int, world: int, kind: str, seed: int, fault: dict[str, Any] | None) -> dict[str, Any]:
    """One run on this rank: its records, the ranks each would evict, its bytes at ``E``/``X`` of each step."""
    from attribution_faults import flip_bit
    from mesh_models import dp_tp_model, fsdp_model, hsdp_model
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from weightsync_audit import LoopAudit
    from weightsync_audit.integrations.evict import evict_targets

    torch.set_num_threads(1)  # exact: TP peers compute the same replicated gradients bit for bit
    model = {"fsdp2": lambda: fsdp_model(2), "hsdp": lambda: hsdp_model()[0], "tp": lambda: dp_tp_model()[0]}[kind]()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = 0

    planted: list[int] = []

    def plant(o: Any, *_: Any) -> None:  # at rest: after the backward (no collective spreads it), before the update
        if o is opt and fault is not None and step == fault["step"] and rank == fault["rank"] and not planted:
            planted.append(step)  # once (attribution's replay steps a copy of the optimizer too)
            t = dict(model.named_parameters(), **dict(model.named_buffers()))[fault["target"]]
            flip_bit(_local(t).detach(), fault["element"], fault["bit"])

    hook = register_optimizer_step_pre_hook(plant)  # before the library's own pre-step hooks
    audit = LoopAudit(model, opt, every_n_steps=1, on_mismatch="resync", attribution=True, verbose=False,
                      timeout_s=60)  # fmt: skip
    g = torch.Generator().manual_seed(seed * 10 + (rank // 2 if kind == "tp" else 0))  # TP peers: same batches
    out: dict[str, Any] = {"records": [], "named": [], "E": [], "X": [], "keys": {}}
    for step in range(1, STEPS + 1):
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        out["E"].append(_snap(model, opt))
        r = audit.step(step)
        out["X"].append(_snap(model, opt))
        out["records"].append(None if r is None else r.to_dict())
        out["named"].append(sorted(evict_targets(r, exiting=True)) if r is not None and not r.in_sync else [])
    out["keys"] = {n: _shard_key(t) for n, t in _tensors(model, opt).items()}
    out["buffers"] = [n for n, _ in model.named_buffers()]
    audit.close()
    hook.remove()
    return out


def _groups(per_rank: list[dict[str, Any]], name: str) -> list[list[int]]:
    by: dict[Any, list[int]] = {}
    for r, o in enumerate(per_rank):
        by.setdefault(o["keys"].get(name), []).append(r)
    return [rs for rs in by.values() if len(rs) > 1]


def _differs(per_rank: list[dict[str, Any]], label: str, i: int, fault: dict[str, Any] | None) -> dict[str, list[int]]:
    """Tensors whose replicas differ at point ``label`` of step ``i + 1``, each with the ranks off the healthy
    bytes (those of a replica that was not flipped)."""
    out: dict[str, list[int]] = {}
    for name in per_rank[0][label][i]:
        for group in _groups(per_rank, name):
            vals = [per_rank[r][label][i][name] for r in group]
            if all(torch.equal(vals[0], v) for v in vals[1:]):
                continue
            healthy = next(r for r in group if fault is None or r != fault["rank"])
            ref = per_rank[healthy][label][i][name]
            out[name] = [r for r in group if not torch.equal(per_rank[r][label][i][name], ref)]
    return out


def _names(name: str, diff: dict[str, list[int]]) -> bool:
    return any(k == name or k.startswith(name + ".") or name.startswith(k + ".") for k in diff)


def score(per_rank: list[dict[str, Any]], fault: dict[str, Any] | None) -> dict[str, Any]:
    row: dict[str, Any] = {c: 0 for c in COLUMNS} | {"repaired": 0, "tie repair": 0, "detail": []}
    for i, rec in enumerate(per_rank[0]["records"]):
        diff = _differs(per_rank, "E", i, fault)
        bad = rec is not None and not rec["in_sync"]
        named = [m["name"] for m in (rec or {}).get("mismatches") or []]
        if bad and (not diff or any(not _names(n, diff) for n in named)):
            row["false alarm"] = 1
            row["detail"].append(f"step {i + 1}: named {named}, bytes differ in {sorted(diff)}")
        if diff and (not bad or not any(_names(n, diff) for n in named)):
            row["fault not named"] = 1
            row["detail"].append(f"step {i + 1}: {sorted(diff)} differ, not named")
        off = set().union(*diff.values()) if diff else set()
        blamed = set(((rec or {}).get("blame") or {}).get("ranks") or [])
        if blamed - off:
            row["false blame"] = 1
            row["detail"].append(f"step {i + 1}: blame {sorted(blamed)}, bytes say {sorted(off)}")
        if set(per_rank[0]["named"][i]) - off:
            row["healthy machine named"] = 1
            row["detail"].append(f"step {i + 1}: evict {per_rank[0]['named'][i]}, bytes say {sorted(off)}")
        for name, ranks in diff.items():
            group = next(g for g in _groups(per_rank, name) if ranks[0] in g)
            after = [per_rank[r]["X"][i][name] for r in group]
            if not all(torch.equal(after[0], a) for a in after[1:]):
                continue
            healthy = next(r for r in group if r not in ranks)
            if torch.equal(after[0], per_rank[healthy]["E"][i][name]):
                row["repaired"] = 1
            elif torch.equal(after[0], per_rank[ranks[0]]["E"][i][name]):
                tie = len(group) == 2 and not blamed and name in per_rank[0]["buffers"]
                row["tie repair" if tie else "repair from corrupted"] = 1
                row["detail"].append(f"step {i + 1}: {name} copied from flipped rank {ranks}")
    return row


def run_one(kind: str, n: int, seed: int) -> dict[str, Any]:
    fault = draw(kind, n, seed)
    try:
        per_rank = launch(run_mesh, KINDS[kind], kind, seed + n, fault, timeout=300)
    except Exception as exc:  # noqa: BLE001 - scored: a hang (no report in time) or a crash
        col = "hang" if "did not finish" in str(exc) else "crash"
        return {c: 0 for c in COLUMNS} | {
            col: 1,
            "repaired": 0,
            "tie repair": 0,
            "detail": [str(exc)[:300]],
            "fault": fault,
        }
    return score(per_rank, fault) | {"fault": fault}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="healthy runs and faulty runs per mesh (each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    lines = []
    for kind in a.kinds.split(","):
        for variant in ("healthy", "fault"):
            rows = [run_one(kind, 2 * n + (variant == "fault"), a.seed) for n in range(a.runs)]
            for r in rows:
                print(f"[{time.perf_counter() - t0:5.0f}s] {kind} {variant} {r['fault']}: "
                      f"{[c for c in COLUMNS if r[c]] or 'ok'} repaired={r['repaired']} {r['detail'][:2]}",
                      file=sys.stderr, flush=True)  # fmt: skip
            lines.append([kind, str(KINDS[kind]), variant, str(len(rows)), *[str(sum(r[c] for r in rows)) for c in
                          COLUMNS], "-" if variant == "healthy" else f"{sum(r['repaired'] for r in rows)}/{len(rows)}",
                          str(sum(r["tie repair"] for r in rows))])  # fmt: skip
    print(table(["mesh", "ranks", "run", "runs", *COLUMNS, "repaired from the healthy replica", "tie repair"], lines))
    print(
        f"\n{time.perf_counter() - t0:.0f} s. Command: `python benchmarks/campaign_mesh.py {' '.join(argv or sys.argv[1:])}`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
