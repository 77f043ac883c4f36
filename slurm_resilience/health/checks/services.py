"""The GPU's service units must be active (NVIDIA Fabric Manager on NVSwitch systems,
nvidia-imex and NVLSM on GB200 NVL72)."""

from __future__ import annotations

from typing import Any

from slurm_resilience.config.health import ServicesCheckSection
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok, unknown

NAME = "services"


def check(snap: dict[str, Any], cfg: ServicesCheckSection, state: dict[str, Any]
          ) -> CheckResult:
    if snap.get("error"):
        return CheckResult([unknown(NAME, "systemd", f"services: {snap['error']}")], state)
    out: list[Finding] = []
    units: dict[str, str] = snap.get("units", {})
    for unit in cfg.units:
        got = units.get(unit, "not asked")
        if got.startswith("error:"):
            out.append(unknown(NAME, unit, f"{unit} state unknown: {got[6:].strip()}"))
        elif got != "active":
            out.append(fail(NAME, unit, f"{unit} {got} (expected active)"))
        else:
            out.append(ok(NAME, unit, f"{unit} active"))
    return CheckResult(out, state)
