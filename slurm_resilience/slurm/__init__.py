"""Everything that talks to Slurm goes through :class:`SlurmAdapter`.

The names below load on first use (PEP 562): hooks import ``slurm.reasons`` and
``slurm.errors`` on every job, and the adapter, its parsers and ``subprocess`` only when
they actually call Slurm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurm_resilience.slurm.adapter import SlurmAdapter, clean_reason, from_config
    from slurm_resilience.slurm.errors import (
        ForeignDrain,
        JobNotFound,
        NodeNotFound,
        SlurmError,
        SlurmTimeout,
    )
    from slurm_resilience.slurm.parse import JobInfo, NodeInfo

_HOME = {
    "SlurmAdapter": "adapter", "clean_reason": "adapter", "from_config": "adapter",
    "ForeignDrain": "errors", "JobNotFound": "errors", "NodeNotFound": "errors",
    "SlurmError": "errors", "SlurmTimeout": "errors", "JobInfo": "parse", "NodeInfo": "parse",
}

__all__ = [
    "ForeignDrain", "JobInfo", "JobNotFound", "NodeInfo", "NodeNotFound", "SlurmAdapter",
    "SlurmError", "SlurmTimeout", "clean_reason", "from_config",
]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
