"""NVSwitch / NVLink fabric of one GPU: registration state, and on GB200 NVL72 the V3
health summary and mask (nvmlGpuFabricInfo_v3_t, field layout as in nvml.h)."""

from __future__ import annotations

from slurm_resilience.health.collectors.nvml_types import GpuRecord
from slurm_resilience.health.findings import Finding, fail

# nvmlGpuFabricState_t
FABRIC_NOT_SUPPORTED = 0
FABRIC_STATES = {0: "NOT_SUPPORTED", 1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}
FABRIC_COMPLETED = 3
# NVML_GPU_FABRIC_HEALTH_SUMMARY_*
SUMMARY = {0: "NOT_SUPPORTED", 1: "HEALTHY", 2: "UNHEALTHY", 3: "LIMITED_CAPACITY"}
# nvmlReturn_t of a probe that completed without joining a domain (nvml.h).
STATUS_NAMES = {23: "INSUFFICIENT_RESOURCES", 3: "NOT_SUPPORTED", 999: "UNKNOWN"}
# (name, shift, width, values that are a fault) of the health mask's fields; each 2-bit
# field is 0 not supported, 1 TRUE (the fault), 2 FALSE, so 0xaa is a healthy mask.
_MASK = (
    ("degraded bandwidth", 0, 0x3, {1: "yes"}),
    ("route recovery in progress", 2, 0x3, {1: "yes"}),
    ("route unhealthy", 4, 0x3, {1: "yes"}),
    ("access timeout recovery", 6, 0x3, {1: "yes"}),
    ("incorrect configuration", 8, 0xF, {2: "sysguid", 3: "chassis serial", 4: "no partition",
                                         5: "insufficient NVLinks", 6: "incompatible GPU FW",
                                         7: "invalid location", 8: "GPU state invalid"}),
    ("fabric manager", 14, 0x3, {2: "disconnected"}),
)


def mask_faults(mask: int) -> list[str]:
    """The faults a V3 health mask reports, e.g. ``["degraded bandwidth"]``."""
    out = []
    for name, shift, width, bad in _MASK:
        value = (mask >> shift) & width
        if value in bad:
            out.append(name if bad[value] == "yes" else f"{name}: {bad[value]}")
    return out


def check(check_name: str, gpu: GpuRecord, subject: str, mode: str, health: bool
          ) -> list[Finding]:
    if mode == "off":
        return []
    fab = gpu.fabric
    if fab is None or fab.state == FABRIC_NOT_SUPPORTED:
        if mode == "required":
            return [fail(check_name, subject, f"{subject} fabric state not reported "
                                              "(expected COMPLETED)")]
        return []
    state = FABRIC_STATES.get(fab.state, str(fab.state))
    if fab.state != FABRIC_COMPLETED:
        return [fail(check_name, subject, f"{subject} fabric {state} (expected COMPLETED; "
                                          "is nvidia-fabricmanager running?)")]
    if fab.status != 0:
        name = STATUS_NAMES.get(fab.status, f"NVML error {fab.status}")
        return [fail(check_name, subject, f"{subject} fabric status {name} (expected success: "
                                          "the GPU joined no NVLink domain)")]
    if not health:
        return []
    faults = mask_faults(fab.health_mask or 0)
    summary = SUMMARY.get(fab.health_summary or 0, str(fab.health_summary))
    if summary in ("UNHEALTHY", "LIMITED_CAPACITY") or faults:
        detail = f": {', '.join(faults)}" if faults else ""
        return [fail(check_name, subject, f"{subject} fabric health {summary}{detail} "
                                          "(expected HEALTHY)",
                     fabric_faults=faults, health_mask=fab.health_mask)]
    return []
