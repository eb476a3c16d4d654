"""The report's old public path, kept working: the writer and reader now live in
:mod:`weightsync_audit.reporting.jsonl` and are importable from ``weightsync_audit``.

>>> from weightsync_audit.report import ReportWriter, read_report
>>> from weightsync_audit import ReportWriter as W
>>> ReportWriter is W
True
"""

from __future__ import annotations

from weightsync_audit.reporting.jsonl import ReportContents, ReportWriter, check_report_path, read_report

__all__ = ["ReportWriter", "ReportContents", "read_report", "check_report_path"]
