"""Reports on finished jobs: per-route statistics and charts, shadow comparisons, chat-format export.

Layering: ``cli.report`` -> ``report`` -> ``service`` (reads output folders, runs ``RowRunner`` for post-hoc
shadows); nothing here imports click. Names are resolved lazily so that the CLI does not import matplotlib
until a report is drawn.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "ReportError": "load", "JobData": "load", "load_output": "load", "resolve_output": "load",
    "RouteStats": "aggregate", "aggregate": "aggregate", "throughput_timeline": "aggregate", "OVERALL": "aggregate",
    "Report": "build", "build_report": "build", "write_report": "build",
    "Pair": "shadow", "ShadowResult": "shadow", "analyze": "shadow", "bootstrap_ci": "shadow",
    "first_divergence": "shadow", "speed_ratio": "shadow",
    "run_posthoc_shadow": "shadow_run", "export_chat": "export", "iter_chat_records": "export",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'racer_batch.report' has no attribute {name!r}")
    return getattr(importlib.import_module(f"racer_batch.report.{_NAMES[name]}"), name)
