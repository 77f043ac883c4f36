"""GPU checks on an NVML snapshot (see :mod:`slurm_resilience.health.collectors.nvml`)."""

from __future__ import annotations

from typing import Any

from slurm_resilience.config.health import GpuCheckSection
from slurm_resilience.health.findings import (
    CheckResult,
    Finding,
    fail,
    human_size,
    ok,
    unknown,
    warn,
)

NAME = "gpu"

# Clock throttle/event reason bits, as in nvml.h (nvmlClocksThrottleReason*).
IDLE = 0x1
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80

# NVSwitch fabric registration (nvmlGpuFabricState_t).
FABRIC_NOT_SUPPORTED = 0
FABRIC_STATES = {0: "NOT_SUPPORTED", 1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}
FABRIC_COMPLETED = 3


def _throttle(gpu: dict[str, Any], subject: str, cfg: GpuCheckSection, streak: int
              ) -> tuple[list[Finding], int]:
    reasons = gpu.get("throttle_reasons")
    if reasons is None:
        return [], 0
    out: list[Finding] = []
    if reasons & HW_THERMAL:
        out.append(fail(NAME, subject, f"{subject} HW thermal slowdown (expected none)"))
    if reasons & HW_POWER_BRAKE:
        out.append(fail(NAME, subject, f"{subject} HW power brake slowdown (expected none)"))
    if reasons & HW_SLOWDOWN and not reasons & (HW_THERMAL | HW_POWER_BRAKE):
        out.append(fail(NAME, subject, f"{subject} HW slowdown (expected none)"))
    streak = streak + 1 if reasons & SW_THERMAL else 0
    if streak >= cfg.sw_thermal_warn_runs:
        out.append(warn(NAME, subject, f"{subject} SW thermal slowdown for {streak} runs",
                        runs=streak))
    # Idle and SW power cap are normal operation and ignored.
    return out, streak


def _pcie(gpu: dict[str, Any], subject: str) -> list[Finding]:
    p = gpu.get("pcie") or {}
    out: list[Finding] = []
    width, width_max = p.get("width"), p.get("width_max")
    if width is not None and width_max is not None and width < width_max:
        out.append(fail(NAME, subject, f"{subject} PCIe x{width} (expected x{width_max})"))
    gen, gen_max = p.get("gen"), p.get("gen_max")
    idle = bool((gpu.get("throttle_reasons") or 0) & IDLE)
    # An idle GPU may lower its link speed to save power; its width never drops.
    if gen is not None and gen_max is not None and gen < gen_max and not idle:
        out.append(fail(NAME, subject, f"{subject} PCIe gen{gen} (expected gen{gen_max})"))
    return out


def _nvlink(gpu: dict[str, Any], subject: str, expected: int) -> list[Finding]:
    links = gpu.get("nvlink")
    if expected == 0:
        return []
    if links is None:
        if expected > 0:
            return [fail(NAME, subject, f"{subject} no NVLink reported (expected {expected})")]
        return []
    active = sum(1 for a in links if a)
    want = len(links) if expected < 0 else expected
    if active < want:
        down = [str(i) for i, a in enumerate(links) if not a]
        return [fail(NAME, subject, f"{subject} NVLink {active}/{len(links)} active "
                                    f"(expected {want}; down: {','.join(down)})")]
    return []


def _leftovers(gpu: dict[str, Any], subject: str, cfg: GpuCheckSection) -> list[Finding]:
    out: list[Finding] = []
    procs = gpu.get("processes")
    if cfg.leftover_processes and procs:
        pids = ",".join(str(p["pid"]) for p in procs[:4])
        out.append(fail(NAME, subject, f"{subject} {len(procs)} leftover process(es) "
                                       f"pid {pids} (expected none)"))
    used = gpu.get("memory_used_bytes")
    if used is not None and used > cfg.leftover_memory:
        out.append(fail(NAME, subject, f"{subject} {human_size(used)} memory in use "
                                       f"(expected <{human_size(cfg.leftover_memory)})"))
    return out


def _fabric(gpu: dict[str, Any], subject: str, mode: str) -> list[Finding]:
    if mode == "off":
        return []
    fab = gpu.get("fabric")
    if fab is None or fab.get("state") == FABRIC_NOT_SUPPORTED:
        if mode == "required":
            return [fail(NAME, subject, f"{subject} fabric state not reported "
                                        "(expected COMPLETED)")]
        return []
    state = FABRIC_STATES.get(fab["state"], str(fab["state"]))
    if fab["state"] != FABRIC_COMPLETED:
        return [fail(NAME, subject, f"{subject} fabric {state} (expected COMPLETED; "
                                    "is nvidia-fabricmanager running?)")]
    if fab.get("status", 0) != 0:
        return [fail(NAME, subject, f"{subject} fabric status NVML error {fab['status']} "
                                    "(expected success)")]
    return []


def _one_gpu(gpu: dict[str, Any], cfg: GpuCheckSection, kind: str, streak: int,
             job_gpus: frozenset[int] | None) -> tuple[list[Finding], int]:
    subject = f"gpu{gpu['index']}"
    if gpu.get("lost"):
        return [fail(NAME, subject, f"{subject} lost (NVML GPU_IS_LOST; expected present)")], 0
    out: list[Finding] = []
    for field, err in sorted(gpu.get("errors", {}).items()):
        out.append(unknown(NAME, subject, f"{subject} couldn't read {field}: NVML {err}"))
    vol = gpu.get("ecc_volatile_uncorrected")
    if vol is not None and vol > cfg.max_volatile_uncorrectable_ecc:
        out.append(fail(NAME, subject, f"{subject} {vol} uncorrectable ECC errors "
                                       f"(expected <={cfg.max_volatile_uncorrectable_ecc})"))
    agg = gpu.get("ecc_aggregate_uncorrected")
    if cfg.max_aggregate_uncorrectable_ecc >= 0 and agg is not None \
            and agg > cfg.max_aggregate_uncorrectable_ecc:
        out.append(fail(NAME, subject, f"{subject} {agg} lifetime uncorrectable ECC errors "
                                       f"(expected <={cfg.max_aggregate_uncorrectable_ecc})"))
    retired = gpu.get("retired_pages")
    if retired is not None and retired > cfg.max_retired_pages:
        out.append(fail(NAME, subject, f"{subject} {retired} retired pages "
                                       f"(expected <={cfg.max_retired_pages})"))
    if cfg.fail_on_retired_pages_pending and gpu.get("retired_pending"):
        out.append(fail(NAME, subject, f"{subject} page retirement pending (reset the GPU)"))
    remap = gpu.get("remap")
    if remap is not None:
        if remap["failed"]:
            out.append(fail(NAME, subject, f"{subject} row remapping failed (replace the GPU)"))
        if remap["pending"] and cfg.fail_on_remap_pending:
            out.append(fail(NAME, subject, f"{subject} row remap pending (reset the GPU)"))
    found, streak = _throttle(gpu, subject, cfg, streak)
    out.extend(found)
    temp = gpu.get("temperature_c")
    if temp is not None and temp > cfg.max_temperature_c:
        out.append(fail(NAME, subject, f"{subject} {temp}C (expected <={cfg.max_temperature_c}C)"))
    if cfg.check_pcie:
        out.extend(_pcie(gpu, subject))
    out.extend(_nvlink(gpu, subject, cfg.expected_nvlinks))
    # Another job may share the node: only the GPUs given to this job must be empty.
    if kind == "prolog" and (job_gpus is None or gpu["index"] in job_gpus):
        out.extend(_leftovers(gpu, subject, cfg))
    out.extend(_fabric(gpu, subject, cfg.fabric_manager))
    if not out:
        out.append(ok(NAME, subject, f"{subject} ok", name=gpu.get("name"),
                      pci=gpu.get("pci_bus_id")))
    return out, streak


def check(snap: dict[str, Any], cfg: GpuCheckSection, state: dict[str, Any], *,
          kind: str = "healthcheck", expected_count: int | None = None,
          job_gpus: frozenset[int] | None = None) -> CheckResult:
    """Findings for every GPU, plus the count against what the node should have.

    ``expected_count`` comes from the job's gres when the config leaves it at -1.
    ``job_gpus`` (prolog): the GPU indices given to the job, the only ones checked for
    leftovers; None checks every GPU (a node without gpu gres runs whole-node jobs).
    """
    want = cfg.expected_count if cfg.expected_count >= 0 else expected_count
    if snap.get("no_driver"):
        # No NVIDIA driver or library: a GPU-less node, unless it should have GPUs.
        if want:
            return CheckResult([fail(NAME, "count", f"0 GPUs visible, {snap['error']} "
                                                    f"(expected {want})")], state)
        return CheckResult([ok(NAME, "nvml", f"no NVIDIA driver: no GPUs expected "
                                             f"({snap['error']})")], state)
    if snap.get("error"):
        return CheckResult([unknown(NAME, "nvml", f"nvml: {snap['error']}")], state)
    findings: list[Finding] = []
    count = snap.get("count") or 0
    if want is not None and count < want:
        findings.append(fail(NAME, "count", f"{count} GPUs visible (expected {want})"))
    streaks: dict[str, int] = dict(state.get("sw_thermal_streak", {}))
    for gpu in snap.get("gpus", []):
        key = str(gpu["index"])
        found, streaks[key] = _one_gpu(gpu, cfg, kind, int(streaks.get(key, 0)), job_gpus)
        findings.extend(found)
    if want is not None and count >= want:
        findings.append(ok(NAME, "count", f"{count} GPUs visible (expected {want})"))
    return CheckResult(findings, {"sw_thermal_streak": streaks})
