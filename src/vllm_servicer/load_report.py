"""The load report's former module: `load_reports.report` holds it now.

Only `interceptors/metrics.py` still imports `LoadReporter` from here (for type
checking); this module goes once that import names `load_reports.report`.
"""

from __future__ import annotations

from .load_reports.report import LoadReporter

__all__ = ["LoadReporter"]
