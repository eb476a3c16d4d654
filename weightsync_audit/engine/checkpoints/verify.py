"""A checkpoint saved with an audit and a sidecar; a checkpoint loaded, checked against its sidecar.

Both are collective (every rank of the audit calls them at the same point) and return the same
:class:`~weightsync_audit.AuditResult` on every rank, with a ``checkpoint`` entry in its record:

- :func:`checkpoint_saved` audits the replicas at the save step; the group's first rank writes the
  sidecar (:mod:`~weightsync_audit.engine.checkpoints.sidecar`) with the verdict, the digest of every tensor
  saved and the size and digest of every file of the checkpoint (``files``; every rank digests its share,
  :mod:`~weightsync_audit.engine.checkpoints.folder`). A ``torch.distributed.checkpoint`` folder gets, in
  addition, each shard file's digest with the rank that wrote it, and every rank's local tensors.
- :func:`checkpoint_loaded` audits the replicas and compares, on every rank, what the rank now holds with
  what the sidecar says was saved: a tensor that differs is a mismatch naming the ranks that hold
  something else (``reference_ranks`` are the ranks that hold what was saved). A checkpoint without a
  sidecar is reported ``unverified`` (warned once per path).

>>> import os, tempfile, torch
>>> from weightsync_audit import Auditor
>>> model = torch.nn.Linear(2, 2)
>>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
>>> torch.save(model.state_dict(), path)
>>> auditor = Auditor(model)
>>> checkpoint_saved(auditor, path, step=10).checkpoint["status"]
'verified'
>>> checkpoint_loaded(auditor, path, step=10).checkpoint["status"]
'matching'
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from weightsync_audit.channel.star import Comm
from weightsync_audit.compat_engines import zero3_param_status
from weightsync_audit.engine.attribution.blame import blame_hint, checkpoint_blame
from weightsync_audit.engine.checkpoints.folder import (
    complete_files,
    dcp_shards,
    digest_share,
    is_dcp_folder,
    list_files,
)
from weightsync_audit.engine.checkpoints.sidecar import (
    SidecarError,
    compare_boxes,
    has_boxes,
    match_prefix,
    new_sidecar,
    read_sidecar,
    same_digest,
    sidecar_path,
    tensor_digests,
    tied_names,
    uncovered_boxes,
    with_boxes,
    write_sidecar,
)
from weightsync_audit.engine.context import AuditHistory
from weightsync_audit.engine.inventory.manifest import as_optimizers, unwrap_module
from weightsync_audit.errors import warn_user
from weightsync_audit.reporting.record import AuditResult, Mismatch
from weightsync_audit.text import without_tie

__all__ = ["checkpoint_evidence", "checkpoint_loaded", "checkpoint_saved"]

_warned_unverified: set[str] = set()
_LOADED_STATUS = {"verified": "matching", "diverged": "diverged"}
"""A load's status from an unchanged checkpoint's verdict; any other verdict (``sampled``) is ``unverified``."""


class CheckpointAuditor(Protocol):
    """What these functions use of an :class:`~weightsync_audit.Auditor` (no import of it here)."""

    module: nn.Module | None
    history: AuditHistory

    @property
    def comm(self) -> Comm: ...

    def audit(
        self,
        module: Any = None,
        optimizer: Any = None,
        *,
        step: Any = None,
        epoch: Any = None,
        hook: Any = None,
        full: bool = False,
    ) -> AuditResult: ...


def _model_state(module: nn.Module | None) -> dict[str, Any]:
    if module is None:
        raise ValueError("a checkpoint needs `state=` or an auditor built with a module")
    return unwrap_module(module).state_dict()


def partitioned_names(module: nn.Module | None) -> set[str]:
    """The module's parameters that this rank holds only as a partition (ZeRO-3 placeholders between
    steps): their ``state_dict`` entries are empty tensors, whose digests would compare nothing."""
    if module is None:
        return set()
    out = set()
    for n, p in unwrap_module(module).named_parameters():
        status = zero3_param_status(p)
        if status is not None and status[0] == "placeholder":
            out.add(n)
    return out


def _drop_partitioned(tensors: dict[str, Any], module: nn.Module | None) -> list[str]:
    """Remove the partitioned parameters' empty digests from ``tensors``; their names as saved."""
    part = partitioned_names(module)
    if not part:
        return []
    prefix = match_prefix(tensors, part)
    dropped = sorted(prefix + n for n in part if prefix + n in tensors)
    for n in dropped:
        del tensors[n]
    return dropped


def _on_first_rank(comm: Comm, fn: Any, what: str) -> Any:
    """``fn()`` on the group's first rank, its JSON result on every rank (an error there: ``{"error"}``)."""
    mine = None
    if comm.rank == 0:
        try:
            mine = json.dumps(fn()).encode()
        except Exception as exc:  # noqa: BLE001 - said on every rank, never a rank-0-only raise
            mine = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
    return json.loads(comm.share_bytes(0, mine, what))


def checkpoint_saved(
    auditor: CheckpointAuditor,
    path: str | os.PathLike[str],
    step: int | None,
    *,
    state: Any = None,
    module: nn.Module | None = None,
    optimizer: Any = None,
    epoch: int | None = None,
    hook: str = "checkpoint_saved",
    result: AuditResult | None = None,
) -> AuditResult:
    """Audit at the save step and write the sidecar of the checkpoint at ``path``. Collective.

    ``state`` is what was saved (default: the module's ``state_dict``); ``result`` an audit already run
    at this step (then no second one, unless it was sampled). The sidecar says ``verified`` only when every
    replica agreed in an audit that compared every byte: under ``coverage="1/n"`` a full pass runs here
    (an auditor that cannot run one gets ``sampled``, which ``verify`` does not accept).
    """
    comm = auditor.comm
    if result is None or result.sampled:
        result = auditor.audit(module, optimizer, step=step, epoch=epoch, hook=hook, full=True)
    held_by = module if module is not None else auditor.module
    obj = state if state is not None else _model_state(held_by)
    # After the audit's rounds every rank has written its files: the first rank lists them, and every rank
    # digests its share of them (its own DCP shards, and every world_size-th other file) in one exchange.
    kind = _on_first_rank(comm, lambda: _kind(path), "the checkpoint's files")
    dcp, listed = bool(kind.get("dcp")), kind.get("files")
    tensors = {} if dcp else (tensor_digests(obj) if comm.rank == 0 else {})
    partitioned = _drop_partitioned(tensors, held_by)
    sidecar = new_sidecar(
        path,
        step=step,
        epoch=epoch,
        world_size=comm.world_size,
        in_sync=result.in_sync,
        diverged=result.diverged_names,
        tensors=tensors,
        coverage=result.coverage,
    )
    tied = tied_names(obj) if comm.rank == 0 and not dcp else {}
    if tied:  # a folder format may save them once: verify accepts exactly these, never a digest look-alike
        sidecar["tied"] = {n: m for n, m in tied.items() if n in tensors and m in tensors}
    if partitioned:  # each rank saved its own partition in the engine's files: nothing to digest here
        sidecar["partitioned"] = partitioned
    me = comm.global_ranks[comm.rank]
    mine: dict[str, Any] = {"rank": me, "files": digest_share(path, listed or {}, comm.rank, comm.world_size)}
    if dcp:  # every rank digests what it wrote: its shard files and its local tensors
        mine.update(tensors=with_boxes(tensor_digests(obj), obj), shards=dcp_shards(path, me))
    parts = [json.loads(p) for p in comm.exchange_bytes(json.dumps(mine).encode(), "the checkpoint's files")]
    if dcp:
        sidecar["rank_tensors"] = {str(p["rank"]): p["tensors"] for p in parts}
        sidecar["shards"] = {f: s for p in parts for f, s in p["shards"].items()}
    status = sidecar["verdict"]
    if comm.rank == 0:
        if listed is not None:  # None: no checkpoint there yet, or unlistable: the files stay unidentified
            found = {f: e for p in parts for f, e in p["files"].items()}
            found.update(
                {f: {"bytes": s["bytes"], "digest": s["digest"]} for f, s in sidecar.get("shards", {}).items()}
            )
            try:
                sidecar["files"] = complete_files(path, listed, found)
            except OSError as exc:  # a file gone while read: the sidecar says nothing of the files
                warn_user(f"weightsync: could not read the files of {path}: {exc}")
        try:
            write_sidecar(path, sidecar)
        except OSError as exc:  # a sidecar that cannot be written never ends the run
            warn_user(f"weightsync: could not write {sidecar_path(path)}: {exc}")
    result.checkpoint = {"path": str(path), "event": "saved", "status": status, "saved_step": step}
    return result


def _kind(path: Any) -> dict[str, Any]:
    """Whether ``path`` is a DCP folder, and its files (:func:`list_files`; a DCP folder's shards aside)."""
    dcp = is_dcp_folder(path)
    return {"dcp": dcp, "files": list_files(path, shards=not dcp)}


def _held_differences(expected: dict[str, Any], held: dict[str, Any], prefix: str | None) -> list[str]:
    """Names (as saved) of the tensors ``held`` whose digest, shape or dtype differ from ``expected``."""
    prefix = match_prefix(expected, held) if prefix is None else prefix
    return [prefix + n for n, e in held.items() if prefix + n in expected and not same_digest(e, expected[prefix + n])]


def _held(state: Any, module: nn.Module | None, optimizer: Any) -> list[Any]:
    """What this rank holds, in groups each matched to the saved names apart: ``state`` by its own names;
    else the module's ``state_dict`` and each optimizer's, each under the prefix it was saved at."""
    if state is not None:
        return [state]
    return [_model_state(module), *(opt.state_dict() for opt in as_optimizers(optimizer))]


def _boxed_differences(
    comm: Comm, saved: dict[str, Any], state: Any, module: nn.Module | None, optimizer: Any
) -> tuple[list[str], list[str]]:
    """Collective: this rank's names that differ from the saved shards it holds whole (any layout: a
    reshard compares equal when it restores the same global tensors; see ``sidecar.compare_boxes``), and the names of
    tensors whose saved shards no rank compared."""
    names = {n for entries in saved.values() for n in entries}
    differ: list[str] = []
    compared: list[list[str]] = []
    for obj in _held(state, module, optimizer):
        prefix = "" if state is not None else match_prefix(names, tensor_digests(obj))
        found, seen = compare_boxes(saved, obj, prefix, str(comm.global_ranks[comm.rank]))
        differ += found
        compared += seen
    everyone = comm.exchange_bytes(json.dumps(compared).encode(), "the compared checkpoint shards")
    return differ, uncovered_boxes(saved, (c for p in everyone for c in json.loads(p)))


def _saved_differences(
    comm: Comm, sidecar: dict[str, Any], state: Any, module: nn.Module | None, optimizer: Any
) -> tuple[list[str], list[str], dict[str, Any]]:
    """This rank's names (as saved) that differ from the sidecar, the names no rank could compare, and the
    digests this rank was compared with (collective when the sidecar records shard boxes)."""
    me = str(comm.global_ranks[comm.rank])
    if has_boxes(sidecar.get("rank_tensors") or {}):  # the same on every rank: the sidecar is rank 0's
        differ, uncovered = _boxed_differences(comm, sidecar["rank_tensors"], state, module, optimizer)
        whole = {
            n: {**e, "shape": e.get("global_shape", e["shape"])}
            for t in sidecar["rank_tensors"].values()
            for n, e in t.items()
        }
        return differ, uncovered, whole
    expected = sidecar.get("rank_tensors", {}).get(me) if "rank_tensors" in sidecar else sidecar["tensors"]
    differ = []
    for obj in _held(state, module, optimizer):
        held = tensor_digests(obj)
        _drop_partitioned(held, module)  # a placeholder held says nothing of the partition loaded
        differ += _held_differences(expected or {}, held, "" if state is not None else None)
    return differ, [], expected or {}


def checkpoint_loaded(
    auditor: CheckpointAuditor,
    path: str | os.PathLike[str],
    step: int | None = None,
    *,
    state: Any = None,
    module: nn.Module | None = None,
    optimizer: Any = None,
    epoch: int | None = None,
    hook: str = "checkpoint_loaded",
) -> AuditResult:
    """After loading the checkpoint at ``path``: audit the replicas and compare, on every rank, what it
    holds (``state``, default the module's ``state_dict``) with the sidecar. Collective; call it before
    the first step. A tensor that differs from what was saved is a mismatch naming the ranks that hold it.
    """
    comm = auditor.comm
    module = module if module is not None else auditor.module

    def read() -> Any:
        try:
            return read_sidecar(path)
        except SidecarError as exc:
            return {"error": str(exc)}

    sidecar = _on_first_rank(comm, read, "the checkpoint sidecar")
    before = auditor.history.state_dict()
    result = auditor.audit(module, optimizer, step=step, epoch=epoch, hook=hook)
    entry: dict[str, Any] = {"path": str(path), "event": "loaded", "status": "unverified", "saved_step": None}
    if sidecar is None or "error" in sidecar:
        why = "it has no sidecar" if sidecar is None else sidecar["error"]
        result.notes.append(f"checkpoint {path} is unverified: {why}")
        if comm.rank == 0 and str(path) not in _warned_unverified:
            _warned_unverified.add(str(path))
            warn_user(f"weightsync: checkpoint {path} is unverified ({why})")
        result.checkpoint = entry
        return result
    differ, uncovered, expected = _saved_differences(comm, sidecar, state, module, optimizer)
    for names, what, why in (
        (uncovered, "tensor(s)", "no rank now holds a whole shard of them as saved (loaded on finer shards than "
         "they were saved in, or not loaded)"),  # a reshard to finer shards
        (sidecar.get("partitioned") or [], "ZeRO-3 partitioned parameter(s)", "each rank holds only its partition, "
         "which the engine's own checkpoint files carry"),
    ):  # fmt: skip
        if names:  # what no rank could compare
            entry["not_compared"] = len(names)
            more = ", ..." if len(names) > 3 else ""
            result.notes.append(
                f"{len(names)} {what} of {path} were not compared ({', '.join(names[:3])}{more}): {why}"
            )
    lists = [json.loads(p) for p in comm.exchange_bytes(json.dumps(differ).encode(), "the checkpoint comparison")]
    entry["saved_step"] = sidecar.get("step")
    changed = _changed_mismatches(comm, lists, expected or {}, module, path, sidecar.get("step"))
    saved_at = f" at step {sidecar['step']}" if sidecar.get("step") is not None else ""
    checkpoint_evidence(result, changed, f"{Path(str(path)).name}{saved_at}")  # one mismatch per tensor
    if changed:
        result.hosts = comm.hosts_of(sorted({r for m in result.mismatches for r in m.ranks}))
    verdict = sidecar["verdict"]
    entry["status"] = "changed" if changed else _LOADED_STATUS.get(verdict, "unverified")
    if verdict == "diverged":
        result.notes.append(
            f"checkpoint {path} was saved while the replicas differed ({', '.join(sidecar.get('diverged', [])[:5])})"
        )
    elif verdict != "verified":
        result.notes.append(
            f"checkpoint {path} is unverified: saved after a sampled audit (coverage {sidecar.get('coverage')}), "
            "which did not compare every byte"
        )
    if changed and result.in_sync:  # the history records this audit as the divergence it is
        result.in_sync = False
        auditor.history.load_state_dict(before)
        auditor.history.record(result)
    result.checkpoint = entry
    return result


def _changed_mismatches(
    comm: Comm, lists: list[list[str]], saved: dict[str, Any], module: nn.Module | None, path: Any, saved_step: Any
) -> list[Mismatch]:
    """One mismatch per tensor some rank holds differently from the sidecar (the same on every rank),
    named as saved (``state_dict.net.0.bias`` in a Lightning checkpoint)."""
    params = {n for n, _ in unwrap_module(module).named_parameters()} if module is not None else set()
    buffers = {n for n, _ in unwrap_module(module).named_buffers()} if module is not None else set()
    prefix = match_prefix(saved, params | buffers) if module is not None else ""
    ranks = comm.global_ranks
    out = []
    for name in sorted({n for names in lists for n in names}):
        odd = [ranks[r] for r, names in enumerate(lists) if name in names]
        ref = [g for g in ranks if g not in odd]
        e = saved.get(name)
        own = name[len(prefix) :] if name.startswith(prefix) else None
        kind = "param" if own in params or module is None else ("buffer" if own in buffers else "optimizer")
        out.append(
            Mismatch(
                name,
                kind,
                odd,
                ref,
                e["shape"] if e else None,
                e["dtype"] if e else None,
                None,
                f"differs from what {Path(str(path)).name} saved"
                + (f" at step {saved_step}" if saved_step is not None else "")
                + " (its sidecar); "
                + ("every rank holds something else" if not ref else "the reference ranks hold what was saved"),
            )
        )
    return out


def _same_tensor(saved: Mismatch, audited: Mismatch) -> bool:
    """``saved`` (named as in the checkpoint: ``state_dict.net.0.bias``) and ``audited`` are one tensor."""
    return audited.kind == saved.kind and (saved.name == audited.name or saved.name.endswith("." + audited.name))


def checkpoint_evidence(result: AuditResult, changed: list[Mismatch], saved: str) -> None:
    """The checkpoint is evidence: a tensor some rank holds other than ``saved`` (the file and its step) is one
    mismatch, the audit's when the ranks differ too (the comparison a property of it): the ranks holding what
    was saved are its reference, the others the wrong side. The blame names them (evidence ``checkpoint``)
    unless the records named ranks already; the hint says so, and where no rank holds the saved bytes."""
    for c in changed:
        m = next((m for m in result.mismatches if _same_tensor(c, m)), None)
        if m is None:
            result.mismatches.append(c)
            continue
        if c.reference_ranks:  # the saved bytes decide which side is right (a tie is one no longer)
            m.ranks, m.reference_ranks = list(c.ranks), list(c.reference_ranks)
            m.detail = without_tie(m.detail)
        m.detail = "; ".join(x for x in (m.detail, c.detail or "") if x)
    if not changed:
        return
    held = result.blame or {}
    if held.get("ranks") and held.get("evidence") not in ("vote", "undecided"):
        return  # named by their own records: the records decide
    blame = checkpoint_blame(changed, saved, result.step)
    result.blame = blame.as_dict()
    said = [h for h in result.hints if not h.startswith(("attribution undecided", "by vote:"))]  # superseded
    result.hints = [blame_hint(blame, result.hosts), *said]
