"""Audit figures for operators: Prometheus (:class:`PrometheusSink`) and OpenTelemetry (:class:`OpenTelemetrySink`).

Both are record sinks: pass them as ``sinks=[...]`` to ``WeightSyncAudit``, ``WeightSyncAuditCallback`` or
``LoopAudit``, and the main process (global rank 0) hands them every record. Each needs its extra
(``weightsync-audit[prometheus]``, ``weightsync-audit[otel]``, both: ``[metrics]``) and loads it only when
its name is first used, so ``import weightsync_audit.metrics`` works without either (docs/metrics.md).

>>> from weightsync_audit.metrics import record_figures
>>> from weightsync_audit import AuditResult
>>> record_figures(AuditResult(in_sync=False)).max_abs_diff
nan
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightsync_audit.metrics.figures import Figures, RankPlace, record_figures
    from weightsync_audit.metrics.otel import OpenTelemetrySink
    from weightsync_audit.metrics.prometheus import PrometheusSink

_LAZY = {
    "Figures": "weightsync_audit.metrics.figures",
    "RankPlace": "weightsync_audit.metrics.figures",
    "record_figures": "weightsync_audit.metrics.figures",
    "OpenTelemetrySink": "weightsync_audit.metrics.otel",
    "PrometheusSink": "weightsync_audit.metrics.prometheus",
}
_EXTRA = {"OpenTelemetrySink": "otel", "PrometheusSink": "prometheus"}

__all__ = ["Figures", "OpenTelemetrySink", "PrometheusSink", "RankPlace", "record_figures"]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync_audit.metrics' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ImportError(
            f"weightsync_audit.metrics.{name} needs {exc.name or 'its package'}, "
            f"the extra weightsync-audit[{_EXTRA.get(name, 'metrics')}] (docs/metrics.md)"
        ) from exc
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
