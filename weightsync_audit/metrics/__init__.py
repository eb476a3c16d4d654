"""Audit figures for operators: Prometheus (:class:`PrometheusSink`) and OpenTelemetry (:class:`OpenTelemetrySink`).

Both are record sinks: pass them as ``sinks=[...]`` to ``WeightSyncAudit``, ``WeightSyncAuditCallback`` or
``LoopAudit``, and the main process (global rank 0) hands them every record. Each needs its extra
(``weightsync-audit[prometheus]``, ``weightsync-audit[otel]``, both: ``[metrics]``) and loads it only when
its name is first used, so ``import weightsync_audit.metrics`` works without either (docs/metrics.md).

Both publish the figures of a record defined here (:func:`record_figures`) and only these, read from the
record alone, so a dashboard reads the same numbers whichever it scrapes.

>>> from weightsync_audit.metrics import record_figures
>>> from weightsync_audit import AuditResult
>>> record_figures(AuditResult(in_sync=False)).max_abs_diff
nan
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weightsync_audit import lazy_names
from weightsync_audit.reporting.record import MISMATCH_KINDS, AuditResult

if TYPE_CHECKING:
    from weightsync_audit.metrics.otel import OpenTelemetrySink
    from weightsync_audit.metrics.prometheus import PrometheusSink

_EXTRAS = {"OpenTelemetrySink": "otel", "PrometheusSink": "prometheus"}
"""The exporters, loaded at their first use: the extra that installs their client, also their module's name here."""

__all__ = [
    "CHECKED_KINDS",
    "DURATION_BUCKETS",
    "GAUGES",
    "Figures",
    "GaugeSpec",
    "OpenTelemetrySink",
    "PrometheusSink",
    "RankPlace",
    "gauge_values",
    "place_labels",
    "record_figures",
]


DURATION_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""The audit-seconds histogram's buckets: a millisecond (a small model) to a minute (hundreds of GB hashed)."""

CHECKED_KINDS: tuple[str, ...] = ("param", "buffer", "optimizer", "grad")
"""The kinds a record counts in ``checked`` (the labels of the per-kind figures)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RankPlace:
    """A rank a divergent record names, and where it runs (from the record's ``hosts``)."""

    rank: int
    """The global rank that disagrees with the reference copy of some tensor."""
    host: str
    """The machine (the first word of the record's ``hosts`` entry); ``unknown`` when the record has none."""
    device: str
    """The rest of the ``hosts`` entry (``local_rank=1 cuda:1 GPU-<uuid> ...``, ``cpu pid=4242``), or ``""``."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Figures:
    """What one record says, as numbers (the same on every rank, published by the main process).

    >>> f = record_figures(AuditResult(in_sync=True, step=7, checked={"param": 4, "buffer": 0, "optimizer": 2, "grad": 0}))
    >>> f.in_sync, f.step, f.checked["param"], f.differing["param"], f.max_abs_diff
    (True, 7, 4, 0, 0.0)
    """

    in_sync: bool
    """Every audited tensor is equal on every rank."""
    step: int | None
    """The record's optimizer step."""
    checked: dict[str, int]
    """Tensors compared, per kind (``param``, ``buffer``, ``optimizer``, ``grad``)."""
    differing: dict[str, int]
    """Tensors that differ, per kind (the checked kinds and ``structure``); all 0 when in sync."""
    beyond_tolerance: int
    """Differing tensors that count (not held within a ``tolerance``)."""
    max_abs_diff: float
    """The largest measured gap (``max_abs_diff``) over the mismatches: 0.0 in sync, NaN when diverged and
    no gap was measured (a structural mismatch, too many tensors, a gap that did not fit its budget)."""
    max_rel_diff: float
    """The largest measured ``rel_diff``; 0.0 in sync, NaN when none was measured."""
    audit_seconds: float
    """How long the audit took on rank 0 (the record's ``duration_ms`` / 1000)."""
    nonfinite_tensors: int | None
    """With ``check_finite``: tensors holding NaN or inf (the record's ``nonfinite_count``), else None."""
    action: str
    """``none``, ``warned``, ``raised``, ``resynced``."""
    ranks: tuple[RankPlace, ...] = field(default=())
    """The ranks a divergent record names (those that disagree with the reference), with their machine."""
    blamed: tuple[RankPlace, ...] = field(default=())
    """The ranks the record's ``blame`` holds responsible, with their machine: the host to drain. Empty in
    sync, without a ``blame``, or when it is undecided (a tie between two replicas with nothing else)."""
    evidence: str = ""
    """What the blame rests on (``vote``, ``at_rest_change``, ``update_not_reproducible``, ...); ``""``: none."""
    hardware_suspect: bool = False
    """The blame points at the machine (memory at rest, a step that does not reproduce), not the software."""


@dataclass(frozen=True, slots=True)
class GaugeSpec:
    """One gauge both exporters set from every record: its sink attribute, its two names, unit, text, label."""

    attr: str
    """The sink's attribute holding the gauge (``sink.checked``), and the key :func:`gauge_values` gives."""
    prometheus: str
    """The Prometheus name after the namespace (``tensors_checked`` -> ``weightsync_tensors_checked``)."""
    otel: str
    """The OpenTelemetry instrument name after the prefix (``tensors.checked`` -> ``weightsync.tensors.checked``)."""
    unit: str
    """The OpenTelemetry unit (UCUM: ``1``, ``{tensor}``; ``""``: none)."""
    description: str
    """The help text, the same in both."""
    label: str | None = None
    """The one label (``kind``) of a per-kind gauge; ``None``: no label."""


GAUGES: tuple[GaugeSpec, ...] = (
    GaugeSpec("in_sync", "in_sync", "in_sync", "1", "1 when the last audit found every replica equal, else 0"),
    GaugeSpec("step", "step", "step", "{step}", "The optimizer step of the last audit"),
    GaugeSpec("checked", "tensors_checked", "tensors.checked", "{tensor}", "Tensors compared by the last audit, per kind",
              "kind"),
    GaugeSpec("differing", "tensors_differing", "tensors.differing", "{tensor}", "Tensors that differ across ranks, "
              "per kind", "kind"),
    GaugeSpec("beyond", "tensors_beyond_tolerance", "tensors.beyond_tolerance", "{tensor}",
              "Differing tensors not held within the tolerance"),
    GaugeSpec("gap", "max_abs_diff", "gap.max_abs", "", "Largest measured gap (0 in sync, NaN: not measured)"),
    GaugeSpec("rel_gap", "max_rel_diff", "gap.max_rel", "1",
              "Largest measured relative gap (0 in sync, NaN: not measured)"),
    GaugeSpec("nonfinite", "nonfinite_tensors", "tensors.nonfinite", "{tensor}", "Audited tensors holding NaN or inf"),
)  # fmt: skip
"""The gauges set from every record, in both exporters (the counters, histogram and per-rank gauges are each
exporter's own: their update rules differ)."""


def gauge_values(f: Figures) -> list[tuple[str, float, dict[str, str]]]:
    """``(GaugeSpec.attr, value, labels)`` for every gauge :data:`GAUGES` that ``f`` sets (a ``step`` or a
    non-finite count the record lacks sets nothing).

    >>> f = record_figures(AuditResult(in_sync=True, step=7))
    >>> gauge_values(f)[:3]
    [('in_sync', 1, {}), ('step', 7, {}), ('checked', 0, {'kind': 'param'})]
    """
    out: list[tuple[str, float, dict[str, str]]] = [("in_sync", int(f.in_sync), {})]
    if f.step is not None:
        out.append(("step", f.step, {}))
    out += [("checked", f.checked[kind], {"kind": kind}) for kind in CHECKED_KINDS]
    out += [("differing", n, {"kind": kind}) for kind, n in f.differing.items()]
    out += [("beyond", f.beyond_tolerance, {}), ("gap", f.max_abs_diff, {}), ("rel_gap", f.max_rel_diff, {})]
    if f.nonfinite_tensors is not None:
        out.append(("nonfinite", f.nonfinite_tensors, {}))
    return out


def place_labels(f: Figures) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The labels of the per-rank gauges, in both exporters: each rank the record names apart (``rank``,
    ``host``, ``device``), and each rank its blame holds responsible (with ``evidence``, ``hardware_suspect``)."""
    named = [{"rank": str(p.rank), "host": p.host, "device": p.device} for p in f.ranks]
    suspect = {"evidence": f.evidence, "hardware_suspect": str(f.hardware_suspect).lower()}
    return named, [{"rank": str(p.rank), "host": p.host, "device": p.device, **suspect} for p in f.blamed]


def _largest(values: list[float | None], in_sync: bool) -> float:
    measured = [v for v in values if v is not None and math.isfinite(v)]
    if in_sync:
        return 0.0
    return max(measured) if measured else math.nan


def record_figures(record: AuditResult) -> Figures:
    """Read :class:`Figures` from a record (an :class:`~weightsync_audit.AuditResult`)."""
    differing = dict.fromkeys((*CHECKED_KINDS, *(k for k in MISMATCH_KINDS if k not in CHECKED_KINDS)), 0)
    for m in record.mismatches:
        differing[m.kind] = differing.get(m.kind, 0) + 1
    hosts = record.hosts or {}
    blame = record.blame or {}
    blamed = [r for r in blame.get("ranks") or [] if isinstance(r, int)]
    return Figures(
        in_sync=record.in_sync,
        step=record.step,
        checked={k: int(record.checked.get(k, 0)) for k in CHECKED_KINDS},
        differing=differing,
        beyond_tolerance=len(record.beyond_tolerance),
        max_abs_diff=_largest([m.max_abs_diff for m in record.mismatches], record.in_sync),
        max_rel_diff=_largest([m.rel_diff for m in record.mismatches], record.in_sync),
        audit_seconds=float(record.duration_ms) / 1e3,
        nonfinite_tensors=record.nonfinite_count,
        action=record.action,
        ranks=_places(sorted({r for m in record.mismatches for r in m.ranks}), hosts),
        blamed=_places(sorted(set(blamed)), hosts),
        evidence=str(blame.get("evidence") or "") if blamed else "",
        hardware_suspect=bool(blame.get("hardware_suspect")) and bool(blamed),
    )


def _places(ranks: list[int], hosts: dict[str, str]) -> tuple[RankPlace, ...]:
    places = []
    for rank in ranks:
        where = hosts.get(str(rank), "").split(None, 1)
        places.append(
            RankPlace(rank=rank, host=where[0] if where else "unknown", device=where[1] if len(where) > 1 else "")
        )
    return tuple(places)


__getattr__, __dir__ = lazy_names(__name__, {n: f"{__name__}.{x}" for n, x in _EXTRAS.items()}, _EXTRAS)
