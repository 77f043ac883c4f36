"""Every health check, one line each: the gate runs them in this order.

Adding a check: a module under ``health/checks/`` ending with its :class:`CheckSpec` (see
:mod:`slurm_resilience.health.checks.spec`), its config section, and a line here.
"""

from __future__ import annotations

from typing import Any

from slurm_resilience.health.checks import (
    diag,
    gdr,
    gpu,
    host_signals,
    infiniband,
    mounts,
    nvme,
    services,
    xid,
)
from slurm_resilience.health.checks.spec import CheckSpec

SPECS: tuple[CheckSpec[Any, Any], ...] = (
    gpu.SPEC,
    xid.SPEC,
    host_signals.SPEC,  # "kernel": host signals in the log the Xid collector read
    infiniband.SPEC,
    nvme.SPEC,
    mounts.SPEC,
    services.SPEC,
    diag.SPEC,  # active: only when named
    gdr.SPEC,  # active: only when named
)
BY_NAME: dict[str, CheckSpec[Any, Any]] = {s.name: s for s in SPECS}
NAMES: tuple[str, ...] = tuple(s.name for s in SPECS)
ACTIVE: tuple[str, ...] = tuple(s.name for s in SPECS if s.active)
