"""Active diagnostics: DCGM where it is installed, else the torch memory test."""

from __future__ import annotations

import shutil
from typing import Any

from slurm_resilience.health.collectors import cuda_memtest, dcgm


def collect_json(tool: str, level: int, timeout: float, nbytes: int, iters: int
                 ) -> dict[str, Any]:
    """``{"dcgm": ...}`` or ``{"memtest": ...}``, for the collector child's JSON pipe."""
    if tool == "dcgmi" or (tool == "auto" and shutil.which("dcgmi")):
        return {"dcgm": dcgm.to_json(dcgm.collect(level, timeout))}
    report = cuda_memtest.collect(nbytes, iters)
    if report.unavailable and tool == "auto":
        report.unavailable = f"dcgmi not installed, and {report.unavailable}"
    return {"memtest": cuda_memtest.to_json(report)}
