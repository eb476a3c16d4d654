"""The bad machine handed on: where schedulers and restart agents look when a verdict names a host to evict.

A machine is named only on evidence that it is the wrong one, decided by the one rule that also picks a
resync's source (:func:`~weightsync_audit.engine.attribution.culprit`): a rank whose tensors read differently
twice with no step between (``stability == "unstable"``), or, when the run ends with ``exit_code``, the
ranks attribution's blame names, else the odd ranks of a strict majority. A tie with nothing else names no
one. This module writes, with no new dependency:

- a plain JSON **evict file** at ``$WEIGHTSYNC_EVICT_FILE`` (schema ``weightsync-evict/1``: ``exit_code``,
  ``step``, ``reason``, ``hosts``: one ``{"rank", "host", "where", "why"}`` per rank named, ``tensors``,
  ``launch_id``; with no rank named, ``hosts: []`` and ``unnamed``: why no machine could be named),
  written by the group's first rank, atomically, that a Slurm or Kubernetes wrapper reads
  (``weightsync-audit launch`` is one: it exits with the run's ``exit_code`` even when torchrun says 1);
- the NVIDIA Resiliency Extension's **segment health-check file**: with
  ``$WEIGHTSYNC_SEGMENT_HEALTH_DIR`` set (the folder given to ``ft_launcher
  --ft-segment-health-check-dir``), each rank named writes, from its own Slurm environment,
  ``segment_health_check.<job_id>.<task_id>`` (``SLURM_ARRAY_JOB_ID`` or ``SLURM_JOB_ID``;
  ``SLURM_ARRAY_TASK_ID`` or the job id), non-empty: the launcher of that segment then keeps it out of
  the next rendezvous (an empty or missing file means healthy);
- the exit status, by the runner (``exit_code``).

>>> from weightsync_audit.reporting.record import AuditResult, Mismatch
>>> r = AuditResult(in_sync=False, step=6, epoch=0, world_size=3, action="raised",
...                 mismatches=[Mismatch("w", "param", [2], [0, 1], [2], "float32", None, "")],
...                 hosts={"2": "node-7 local_rank=2 cpu pid=42"})
>>> evict_targets(r, exiting=True)
{2: 'odd rank under exit_code: a strict majority holds the reference value, rank 2 another'}
>>> tie = Mismatch("w", "param", [1], [0], [2], "float32", None, "tie vote: rank 0 vs rank 1, no majority")
>>> evict_targets(AuditResult(in_sync=False, step=6, world_size=2, mismatches=[tie]), exiting=True)
{}
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from weightsync_audit.engine.attribution import culprit
from weightsync_audit.reporting.record import AuditResult

__all__ = [
    "EVICT_FILE_ENV",
    "EVICT_SCHEMA",
    "EXIT_STATUS_DIR_ENV",
    "LAUNCH_ID_ENV",
    "hand_off_problems",
    "read_exit_statuses",
    "SEGMENT_DIR_ENV",
    "evict_targets",
    "leave_together",
    "read_evict",
    "segment_health_file",
    "unnamed_reason",
    "unwritable",
    "write_evict",
]

EVICT_SCHEMA = "weightsync-evict/1"
EVICT_FILE_ENV = "WEIGHTSYNC_EVICT_FILE"
"""Where the JSON evict file goes (none written when unset)."""
SEGMENT_DIR_ENV = "WEIGHTSYNC_SEGMENT_HEALTH_DIR"
"""The NVIDIA Resiliency Extension's segment health-check folder (none written when unset)."""
LAUNCH_ID_ENV = "WEIGHTSYNC_LAUNCH_ID"
"""Set by ``weightsync-audit launch``: the evict file says which launch wrote it."""
EXIT_STATUS_DIR_ENV = "WEIGHTSYNC_EXIT_STATUS_DIR"
"""Set by ``weightsync-audit launch`` to a private folder of its own: every rank that ends the run with
``exit_code`` leaves ``exit.<rank>`` there, so the launcher exits with that code even when the evict file
could not be written (a full disk, a folder gone)."""


def evict_targets(result: AuditResult, *, exiting: bool) -> dict[int, str]:
    """Global rank -> why its host is to be evicted, from the record alone (the same on every rank): only on
    evidence that it is the wrong one (:func:`~weightsync_audit.engine.attribution.culprit`)."""
    who = culprit(result.mismatches, result.blame)
    out: dict[int, str] = {}
    for m in result.mismatches:
        if m.stability == "unstable":
            for r in m.ranks:
                out[r] = "unstable: its tensors read differently twice with no step between (suspect hardware)"
    if exiting:
        for r in who.ranks:
            out.setdefault(r, f"odd rank under exit_code: {who.why}")
    return dict(sorted(out.items()))


def unnamed_reason(result: AuditResult) -> str:
    """Why no machine could be named for eviction (the evict file's ``unnamed``)."""
    return f"no machine could be named: {culprit(result.mismatches, result.blame).why}"


def _host(where: str | None) -> str | None:
    return where.split()[0] if where else None


def segment_health_file(folder: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Path | None:
    """This process's segment health-check file in ``folder`` (NVRx's name), or ``None`` outside Slurm.

    >>> segment_health_file("/shared/health", {"SLURM_JOB_ID": "4242"}).name
    'segment_health_check.4242.4242'
    """
    environ = os.environ if env is None else env
    job = environ.get("SLURM_ARRAY_JOB_ID") or environ.get("SLURM_JOB_ID")
    if not job:
        return None
    task = environ.get("SLURM_ARRAY_TASK_ID") or job
    return Path(folder) / f"segment_health_check.{job}.{task}"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def unwritable(path: str | os.PathLike[str], *, folder: bool = False) -> str | None:
    """Why a file (or, with ``folder``, a folder to write files in) at ``path`` cannot be written, or
    ``None``: its nearest existing ancestor must be a folder this process may write in (it creates the
    rest), and the path itself, when it exists, a file (a folder) it may write. Nothing is created.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile() as f:  # a file where a folder should be
    ...     unwritable(f"{f.name}/evict.json").endswith("is not a folder")
    True
    """
    p = Path(path).absolute()
    if p.exists():
        if folder != p.is_dir():
            return f"{p} is {'not ' if folder else ''}a folder"
        return None if os.access(p, os.W_OK | (os.X_OK if folder else 0)) else f"{p} is not writable"
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{parent} is not writable"


def hand_off_problems(env: Mapping[str, str] | None = None) -> list[str]:
    """The hand-off paths of the environment (``$WEIGHTSYNC_EVICT_FILE``, ``$WEIGHTSYNC_SEGMENT_HEALTH_DIR``)
    that cannot be written, each naming its variable; local, checked when a run opens its audits."""
    environ = os.environ if env is None else env
    out = []
    for var, folder in ((EVICT_FILE_ENV, False), (SEGMENT_DIR_ENV, True)):
        value = environ.get(var)
        why = unwritable(value, folder=folder) if value else None
        if why is not None:
            out.append(f"{var}={value}: {why}")
    return out


def _write_exit_status(result: AuditResult, rank: int, exit_code: int, environ: Mapping[str, str]) -> None:
    """``exit.<rank>`` in the launcher's own folder: the exit code carried even when the evict file is not."""
    folder = environ.get(EXIT_STATUS_DIR_ENV)
    if not folder:
        return
    doc = {"exit_code": exit_code, "rank": rank, "step": result.step}
    doc["attempt"] = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    try:
        _write_atomic(Path(folder) / f"exit.{rank}", json.dumps(doc) + "\n")
    except OSError:
        pass  # the exit status itself still says it


def read_exit_statuses(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The ``exit.<rank>`` records the ranks left in ``folder`` (:data:`EXIT_STATUS_DIR_ENV`), by rank."""
    out = []
    for f in sorted(Path(folder).glob("exit.*")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("exit_code"), int):
            out.append(doc)
    return sorted(out, key=lambda d: d.get("rank", 0))


def write_evict(
    result: AuditResult, *, rank: int, is_main: bool, exit_code: int | None, env: Mapping[str, str] | None = None
) -> list[Path]:
    """Write what the environment asks for (``$WEIGHTSYNC_EVICT_FILE``, ``$WEIGHTSYNC_SEGMENT_HEALTH_DIR``)
    about ``result``; local (no message), never raises. ``rank``: this process's global rank. The paths
    written on this rank come back. With ``exit_code``, every rank also leaves its status for the launcher
    (:data:`EXIT_STATUS_DIR_ENV`), whether or not the evict file can be written."""
    environ = os.environ if env is None else env
    if exit_code is not None:
        _write_exit_status(result, rank, exit_code, environ)
    targets = evict_targets(result, exiting=exit_code is not None)
    written: list[Path] = []
    evict_file = environ.get(EVICT_FILE_ENV)
    try:
        if evict_file and is_main and (targets or exit_code is not None):
            hosts = result.hosts or {}
            doc: dict[str, Any] = {
                "schema": EVICT_SCHEMA,
                "time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "launch_id": environ.get(LAUNCH_ID_ENV),
                "attempt": int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                "exit_code": exit_code,
                "step": result.step,
                "reason": "diverged" if exit_code is not None else "hardware-suspect",
                "hosts": [
                    {"rank": r, "host": _host(hosts.get(str(r))), "where": hosts.get(str(r)), "why": why}
                    for r, why in targets.items()
                ],
                "tensors": result.diverged_names[:20],
            }
            if not targets:
                doc["unnamed"] = unnamed_reason(result)
            path = Path(evict_file)
            _write_atomic(path, json.dumps(doc) + "\n")
            written.append(path)
        folder = environ.get(SEGMENT_DIR_ENV)
        if folder and rank in targets:
            path = segment_health_file(folder, environ)  # type: ignore[assignment]
            if path is not None:
                _write_atomic(path, f"weightsync: rank {rank} {targets[rank]} at step {result.step}\n")
                written.append(path)
    except OSError as exc:  # the hand-off never ends the run by itself; the exit status still says it
        from weightsync_audit.errors import warn_user

        warn_user(f"weightsync: could not write the evict hand-off: {exc}")
    return written


def read_evict(path: str | os.PathLike[str], launch_id: str | None = None) -> dict[str, Any] | None:
    """The evict file at ``path`` (``None`` when absent, unreadable, another schema, or written by
    another launch than ``launch_id``)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != EVICT_SCHEMA:
        return None
    if launch_id is not None and doc.get("launch_id") != launch_id:
        return None
    return doc


def leave_together(comm: Any, is_main: bool) -> None:
    """Before every rank ends its process: wait until the first rank, which writes the record and the evict
    file, is here too (one round, within the audit's timeout; a launcher kills the other workers as soon
    as the first exits). A peer already gone is no reason to stay."""
    try:
        comm.share_bytes(0, b"" if is_main else None, "the exit")
    except Exception:  # noqa: BLE001
        pass
