"""Campaign rows for evidence with a lifetime (issue 49): a divergence that persists, then a second fault on
another rank; a resume with one rank off the checkpoint; LocalSGD with a faulty sync.

    python benchmarks/campaign_attribution.py --persisting --runs-per-kind 2 --seed 0
    python benchmarks/campaign_lifetime.py --resume --runs 2 --seed 0
    python benchmarks/campaign_lifetime.py --localsgd --runs 2 --seed 0

**Persisting** (each run a plain gloo DDP + Adam loop, ``tests/attribution_faults.py``, 10 steps, an audit every
step, ``attribution=True``): a first divergence on one drawn rank that is never repaired, then a bit flip at
rest on another drawn rank, in a drawn tensor, element and bit (20-30). Variants: ``drift`` (every element of
``2.weight`` times ``1 + 1e-6`` under ``tolerance=1e-4``: tolerated) on 2, 3 and 4 ranks under ``warn`` and
``resync``; ``tie`` (the first divergence a bit flip too, no tolerance, 2 ranks, ``warn``: no repair, and two
ranks only tie); ``raise`` (the drift, 3 ranks, ``on_mismatch="raise"`` + ``exit_code=17``: every rank exits,
the evict file names the machines); ``overlap`` (the drift, ``overlap=True``, ``resync`` on 2 and 3 ranks).

The truth owes nothing to the library: each rank copies the flipped tensor's bytes right before the audit call
(``E``), right after it (``X``), at the end of the step's work (``A``) and inside the next optimizer step after
every pre-step hook (``P``, where an overlapped resync lands). Scored at the flip's audit (the record covering
the step after the flip): *false blame* (``blame.ranks`` is not exactly the flipped rank), *repair from a
corrupted source* (between two points with no training between them, ``E``->``X`` or ``A``->``P``, the ranks
went from differing to equal to the flipped rank's bytes), *healthy machine named* (``evict_targets`` under
``exit_code``, or the evict file itself under ``raise``, names another rank).

**Resume** (``--resume``): 2 ranks train 3 steps, rank 0 saves the model and every rank records the save
(``checkpoint_saved``); 2 more steps; every rank loads the file back, but in a faulty run one drawn rank loads
other bytes (its own, scaled); then ``checkpoint_loaded`` with ``on_mismatch="resync"``. Truth: each rank's
bytes against the file (``torch.load``, ``torch.equal``) before and after. Columns: *false alarm* (a healthy
resume reported diverged), *fault not named*, *false blame* (``blame`` not exactly the off rank, or its
evidence not ``checkpoint``), *repair from a corrupted source* (after the resync a rank does not hold the saved
bytes), *healthy machine named*.

**LocalSGD** (``--localsgd``): 2 and 3 torchft replica groups (``tests/torchft_jobs.py``: a real lighthouse, one
process per group; torchft heals the others from replica 0 at the first quorum), LocalSGD every 3 local steps,
3 syncs, ``TorchFTAudit(sync=...)`` auditing every sync under ``warn``. In a faulty run one drawn replica's
all-reduced result is flipped (one drawn bit, 12-22, of one element of one parameter) before LocalSGD copies it
into the model: at the first sync (the one whose audit is handed the heal) in even runs, the second in odd
ones. Truth: each replica's parameters right after each sync (a post-step hook after LocalSGD's), compared
across replicas here (``torch.equal``). Columns: *false alarm* (a record diverged where the bytes agree),
*fault not named* (no record from the faulty sync on names the flipped tensor), *false blame* (a blame naming
another replica, or the heal: ``heal`` in its detail, evidence ``deterministic_difference``, a heal not
verified), *heal verified or blamed* (any record with ``torchft.healed`` or a note saying ``verified``: a heal's
evidence ends at the first committed sync), *healthy machine named* (``evict_targets(..., exiting=True)`` names
another replica).
``on_mismatch="resync"`` is refused under torchft (it heals replicas itself): no repair column.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # the faults live with the tests

from attribution_faults import build, flip_bit, train_step
from harness import launch, table  # puts tests/ on the path

STEPS = 10
VARIANTS: tuple[tuple[str, int, str], ...] = (
    *(("drift", w, m) for w in (2, 3, 4) for m in ("warn", "resync")),
    ("tie", 2, "warn"),
    ("raise", 3, "raise"),
    ("overlap", 2, "resync"),
    ("overlap", 3, "resync"),
)
"""``(first divergence, ranks, on_mismatch)`` of each persisting row."""


def draw_persisting(world: int, n: int, seed: int) -> dict[str, int]:
    """Run ``n`` of the persisting pattern on ``world`` ranks: who drifts, who flips, when and where."""
    rng = random.Random(f"{seed}-persisting-{world}-{n}")
    drifting, flipped = rng.sample(range(world), 2)
    drift_after = rng.randint(2, 4)
    return {"drifting": drifting, "flipped": flipped, "drift_after": drift_after,
            "flip_after": drift_after + rng.randint(1, 3), "param": rng.randrange(4), "element": rng.randrange(64),
            "bit": rng.randrange(20, 31)}  # fmt: skip


def run_persisting(rank: int, world: int, plan: dict[str, int], first: str, mode: str, folder: str) -> dict[str, Any]:
    """One run on this rank: the flipped tensor's bytes at each point, and (on a ``raise``) how it ended."""
    from weightsync_audit import LoopAudit, WeightDivergenceError

    os.environ["WEIGHTSYNC_EVICT_FILE"] = os.path.join(folder, "evict.json")
    _, ddp, opt = build(rank)
    audit = LoopAudit(ddp, opt, every_n_steps=1, on_mismatch=mode, verbose=False, attribution=True,
                      tolerance=None if first == "tie" else 1e-4, overlap=first == "overlap",
                      exit_code=17 if mode == "raise" else None, report_path=os.path.join(folder, "r.jsonl"))  # fmt: skip
    params = list(ddp.parameters())
    points: dict[str, torch.Tensor] = {}
    step = 0

    def snap(label: str) -> None:
        points[f"{label}{step}"] = params[plan["param"]].detach().clone()

    handle = opt.register_step_pre_hook(lambda *_: snap("P"))  # after the library's own pre-step hooks
    for step in range(1, STEPS + 1):
        train_step(ddp, opt, rank, step, None)
        snap("E")
        try:
            audit.step(step)
        except WeightDivergenceError as exc:  # every copy poisoned (a flip's inf/NaN spread by the next step)
            if mode != "resync" or "resync impossible" not in str(exc.result.notes):
                raise
            points["refused"] = torch.ones(())  # the library refused to copy from a poisoned rank: the run ends
            break
        snap("X")
        if step == plan["drift_after"] and rank == plan["drifting"]:
            if first == "tie":
                flip_bit(params[2], 3, 29)
            else:
                with torch.no_grad():
                    params[2].mul_(1 + 1e-6)  # within the tolerance, spread over every element
        if step == plan["flip_after"] and rank == plan["flipped"]:
            flip_bit(params[plan["param"]], plan["element"], plan["bit"])
        snap("A")
    handle.remove()
    audit.close()
    return points


def _corrupted(per_rank: list[dict[str, torch.Tensor]], flipped: int) -> bool:
    """Between two points with no training between them the ranks went from differing to equal to the flipped
    rank's bytes."""
    for s in range(1, STEPS + 1):
        for a, b in ((f"E{s}", f"X{s}"), (f"A{s}", f"P{s + 1}")):
            if b not in per_rank[0]:
                continue
            before = [p[a] for p in per_rank]
            after = [p[b] for p in per_rank]
            differed = any(not torch.equal(before[0], x) for x in before[1:])
            if differed and all(torch.equal(after[0], x) for x in after[1:]) and torch.equal(after[0], before[flipped]):
                return any(not torch.equal(before[flipped], x) for i, x in enumerate(before) if i != flipped)
    return False


def _reads_flip(rec: dict[str, Any], flip_after: int) -> bool:
    """The record is the first to read the flip planted after the audit call of step ``flip_after``: the one
    covering the next step, or with ``overlap`` the one covering ``flip_after`` when its read raced the flip
    (the flip landed inside its window)."""
    over = rec.get("overlap") or {}
    covers = int(over.get("covers_step", rec["step"]))
    return covers == flip_after + 1 or (covers == flip_after and bool(over.get("raced")) and not rec["in_sync"])


def one_persisting(world: int, first: str, mode: str, n: int, seed: int) -> dict[str, Any]:
    """One run, scored (see the module's docstring)."""
    from ranks import RankDied, run_ranks

    from weightsync_audit import read_report
    from weightsync_audit.integrations.evict import evict_targets, read_evict

    plan = draw_persisting(world, n, seed)
    f = plan["flipped"]
    with tempfile.TemporaryDirectory() as folder:
        per_rank = run_ranks(run_persisting, world, plan, first, mode, folder, timeout=300, pg_timeout_s=120,
                             may_die=range(world) if mode == "raise" else ())  # fmt: skip
        recs = [r for _, r in read_report(os.path.join(folder, "r.jsonl")).records]
        doc = read_evict(os.path.join(folder, "evict.json"))
    at = [r for r in recs if _reads_flip(r.to_dict(), plan["flip_after"])]
    if not at:
        return {"false": 1, "right": 0, "corrupted": 0, "healthy": 0, "detail": f"no record of the flip's step {plan}"}
    rec = at[0].to_dict()
    blame = rec.get("blame") or {}
    out = {"false": int(blame.get("ranks") != [f]), "detail": f"{plan} blame {blame.get('ranks')} {blame.get('evidence')}",
           "right": int(blame.get("ranks") == [f] and blame.get("evidence") == "at_rest_change")}  # fmt: skip
    if mode == "raise":
        died = all(isinstance(o, RankDied) and o.exitcode == 17 for o in per_rank)
        hosts = [h["rank"] for h in (doc or {}).get("hosts", [])]
        out["healthy"] = int(not died or hosts != [f])
        out["detail"] += f" evict {hosts} exits {[getattr(o, 'exitcode', o) for o in per_rank]}"
        out["corrupted"] = 0
        return out
    out["healthy"] = int(any(r != f for r in evict_targets(at[0], exiting=True)))
    out["refused"] = int(any(p.pop("refused", None) is not None for p in per_rank))
    out["corrupted"] = int(mode == "resync" and _corrupted(per_rank, f))
    if out["refused"]:
        out["detail"] += " (resync refused: every rank's copy held NaN or inf)"
    return out


def persisting(runs: int, seed: int, only: str = "") -> None:
    """The persisting pattern's table (see the module's docstring)."""
    rows = []
    t0 = time.perf_counter()
    for first, world, mode in VARIANTS:
        if only and first not in only.split(","):
            continue
        got = [one_persisting(world, first, mode, n, seed) for n in range(runs)]
        for g in got:
            print(f"[{time.perf_counter() - t0:5.0f}s] {first} w{world} {mode}: {g['detail']}", file=sys.stderr)
        c = {k: sum(g.get(k, 0) for g in got) for k in ("right", "false", "corrupted", "healthy", "refused")}
        rows.append([first, str(world), mode + (" + exit_code" if mode == "raise" else ""), str(runs),
                     f"{c['right']}/{runs}", str(c["false"]), str(c["corrupted"]) if mode == "resync" else "-",
                     str(c["healthy"]), str(c["refused"]) if mode == "resync" else "-"])  # fmt: skip
    print(table(["first divergence", "ranks", "on_mismatch", "runs", "flip blamed (at_rest_change)", "false blame",
                 "repair from a corrupted source", "healthy machine named", "resync refused (no finite copy)"],
                rows))  # fmt: skip


def run_resume(rank: int, world: int, off: int | None, folder: str) -> dict[str, Any]:
    """One resume on this rank: the load's record, the ranks an evict file would name, and whether this rank
    holds the saved bytes before and after the load's audit (``torch.equal`` against the file)."""
    import torch.distributed as dist

    from weightsync_audit import LoopAudit
    from weightsync_audit.integrations.evict import evict_targets

    model, ddp, opt = build(rank)
    audit = LoopAudit(model, None, on_mismatch="resync", verbose=False)
    path = os.path.join(folder, "step3.pt")
    for step in range(1, 6):
        train_step(ddp, opt, rank, step, None)
        if step == 3:
            if rank == 0:
                torch.save(model.state_dict(), path)
            audit.checkpoint_saved(path, 3)
    dist.barrier()
    saved = torch.load(path, weights_only=True)
    model.load_state_dict({k: v * 1.5 for k, v in saved.items()} if rank == off else saved)

    def holds() -> bool:
        return all(torch.equal(saved[k], v) for k, v in model.state_dict().items())

    before = holds()
    r = audit.checkpoint_loaded(path, 3)
    audit.close()
    named = sorted(evict_targets(r, exiting=True)) if r is not None and not r.in_sync else []
    return {"record": None if r is None else r.to_dict(), "named": named, "before": before, "after": holds()}


def one_resume(world: int, off: int | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        per_rank = launch(run_resume, world, off, folder, timeout=300)
    rec, off_ranks = per_rank[0]["record"] or {}, [r for r, o in enumerate(per_rank) if not o["before"]]
    blame = rec.get("blame") or {}
    out = {"truth_off": off_ranks, "detail": f"off {off_ranks}: blame {blame.get('ranks')} {blame.get('evidence')}"
           f" action {rec.get('action')} named {per_rank[0]['named']} holds after {[o['after'] for o in per_rank]}"}  # fmt: skip
    out["false alarm"] = int(not off_ranks and not rec.get("in_sync", True))
    out["fault not named"] = int(bool(off_ranks) and not {r for m in rec.get("mismatches") or [] for r in m["ranks"]}
                                 >= set(off_ranks))  # fmt: skip
    out["false blame"] = int(
        bool(off_ranks) and (blame.get("ranks") != off_ranks or blame.get("evidence") != "checkpoint")
    )
    out["repair from a corrupted source"] = int(not all(o["after"] for o in per_rank))
    out["healthy machine named"] = int(bool(set(per_rank[0]["named"]) - set(off_ranks)))
    return out


RESUME_COLUMNS = ("false alarm", "fault not named", "false blame", "repair from a corrupted source",
                  "healthy machine named")  # fmt: skip


def resume(runs: int, seed: int) -> None:
    """The resume rows' table (see the module's docstring)."""
    rows = []
    t0 = time.perf_counter()
    for world in (2, 3):
        for variant in ("healthy", "one rank off"):
            got = []
            for n in range(runs):
                off = None if variant == "healthy" else random.Random(f"{seed}-resume-{world}-{n}").randrange(world)
                got.append(one_resume(world, off))
                print(f"[{time.perf_counter() - t0:5.0f}s] resume w{world} {variant}: {got[-1]['detail']}",
                      file=sys.stderr)  # fmt: skip
            rows.append([str(world), variant, str(runs), *[str(sum(g[c] for g in got)) for c in RESUME_COLUMNS]])
    print(table(["ranks", "resume", "runs", *RESUME_COLUMNS], rows))


SYNC_EVERY, SYNCS = 3, 3
SIZES = (256, 64, 128, 2)  # the torchft jobs' MLP (4 -> 64 -> 2): 0.weight, 0.bias, 2.weight, 2.bias
LOCALSGD_COLUMNS = ("false alarm", "fault not named", "false blame", "heal verified or blamed",
                    "healthy machine named")  # fmt: skip


def _replica_rank(rec: dict[str, Any], index: int) -> int:
    """Replica group ``index``'s rank in the record's quorum (``torchft.replicas``: rank -> replica id)."""
    return next(int(r) for r, rid in rec["torchft"]["replicas"].items() if rid.split(":")[0] == f"replica{index}")


def one_localsgd(world: int, faulty: bool, n: int, seed: int) -> dict[str, Any]:
    """One LocalSGD job on ``world`` replica groups, scored against the bytes each replica held after each sync."""
    from torchft_jobs import Replica, run_job

    from weightsync_audit import AuditResult
    from weightsync_audit.integrations.evict import evict_targets

    rng = random.Random(f"{seed}-localsgd-{world}-{n}")
    f, param = rng.randrange(world), rng.randrange(4)
    fault = {"sync": 1 + n % 2, "param": param, "element": rng.randrange(SIZES[param]),
             "bit": rng.randrange(12, 23)}  # fmt: skip
    reps = [Replica(i, extra={"sync_fault": fault} if faulty and i == f else {}) for i in range(world)]
    res = run_job(reps, mode="localsgd", steps=SYNC_EVERY * SYNCS, sync_every=SYNC_EVERY, every=1, deadline_s=300)
    # The truth: each replica's parameters right after each sync (a hook after LocalSGD's), compared here.
    differ: dict[int, list[int]] = {}
    for local in range(SYNC_EVERY, SYNC_EVERY * SYNCS + 1, SYNC_EVERY):
        snaps = [res[(i, 0)]["snapshots"][local] for i in range(world)]
        keys = [k for k in snaps[0] if k.startswith("p:")]
        same = [sum(all(torch.equal(s[k], o[k]) for k in keys) for o in snaps) for s in snaps]
        differ[snaps[0]["manager_step"]] = [i for i in range(world) if same[i] <= world // 2]  # not in a majority
    at = min((s for s, odd in differ.items() if odd), default=None)
    recs = [r for i in range(world) for r in res[(i, 0)]["records"]]
    out = {"detail": f"plan {f if faulty else None} {fault if faulty else ''} truth {differ}"}
    out["false alarm"] = int(any(not r["in_sync"] and not differ.get(r["step"]) for r in recs))
    out["heal verified or blamed"] = int(any(r["torchft"].get("healed") or any("verified" in x for x in r["notes"])
                                             for r in recs))  # fmt: skip
    seen = sorted((r for r in recs if at is not None and r["step"] >= at and not r["in_sync"]), key=lambda r: r["step"])
    flipped = ("0.weight", "0.bias", "2.weight", "2.bias")[param]
    out["fault not named"] = int(faulty and not any(m["name"] == flipped for r in seen for m in r["mismatches"]))
    false, healthy = False, False
    for rec in seen:  # every replica's copy of each divergent record from the faulty sync on
        blame, mine = rec.get("blame") or {}, _replica_rank(rec, f)
        healed = any(not h.get("verified", True) for h in rec["torchft"].get("healed", {}).values())
        false |= (blame.get("ranks", []) not in ([], [mine]) or "heal" in blame.get("detail", "")
                  or blame.get("evidence") == "deterministic_difference" or healed)  # fmt: skip
        named = evict_targets(AuditResult.from_dict(rec), exiting=True)
        healthy |= bool(set(named) - {mine})
        out["detail"] += (f" | step {rec['step']} odd {[(m['name'], m['ranks']) for m in rec['mismatches']]} (faulted is rank "
                          f"{mine}) blame {blame.get('ranks')} {blame.get('evidence')} evict {sorted(named)} heal noted "
                          f"{[x for x in rec['notes'] if 'before this sync' in x]}")  # fmt: skip
    out["false blame"], out["healthy machine named"] = int(false), int(healthy)
    first = (seen[0].get("blame") or {}).get("ranks") if seen else None
    out["blamed"] = int(first == [_replica_rank(seen[0], f)]) if seen else 0
    out["undecided"] = int(first == [] or (bool(seen) and first is None))
    return out


def localsgd(runs: int, seed: int, worlds: tuple[int, ...] = (2, 3)) -> None:
    """The LocalSGD rows' table (see the module's docstring)."""
    rows = []
    t0 = time.perf_counter()
    for world in worlds:
        for variant in ("healthy", "faulty sync"):
            got = []
            for n in range(runs):
                got.append(one_localsgd(world, variant != "healthy", n, seed))
                print(f"[{time.perf_counter() - t0:5.0f}s] localsgd w{world} {variant}: {got[-1]['detail']}",
                      file=sys.stderr)  # fmt: skip
            blamed = "-"
            if variant != "healthy":
                blamed = f"{sum(g['blamed'] for g in got)} / {sum(g['undecided'] for g in got)}"
            rows.append(
                [str(world), variant, str(runs), blamed, *[str(sum(g[c] for g in got)) for c in LOCALSGD_COLUMNS]]
            )
    print(table(["replica groups", "sync", "runs", "blame: the faulted replica / none", *LOCALSGD_COLUMNS], rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", "--runs-per-kind", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="the resume rows (default: the persisting pattern)")
    ap.add_argument("--localsgd", action="store_true", help="the LocalSGD rows (torchft, a faulty sync)")
    ap.add_argument("--worlds", default="2,3", help="--localsgd: the numbers of replica groups")
    ap.add_argument("--variants", default="", help="persisting: comma-separated first divergences (default all)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.localsgd:
        localsgd(a.runs, a.seed, tuple(int(w) for w in a.worlds.split(",")))
    else:
        resume(a.runs, a.seed) if a.resume else persisting(a.runs, a.seed, a.variants)
    print(
        f"\n{time.perf_counter() - t0:.0f} s. Command: `python benchmarks/campaign_lifetime.py {' '.join(argv or sys.argv[1:])}`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
