"""GPU checks on an NVML snapshot (see :mod:`slurm_resilience.health.collectors.nvml`).

Pure functions of the snapshot, the config and the state the previous run left
(counter baselines, throttle samples, streaks). Counters that only ever grow
(NVLink errors, PCIe replays, SRAM correctables) are judged by their rise since
the last run, as the InfiniBand counters are, so history does not fail a node forever.
"""

from __future__ import annotations

from typing import Any

from slurm_resilience import gpu_models
from slurm_resilience.config.health import GpuCheckSection
from slurm_resilience.health.checks import gpu_fabric
from slurm_resilience.health.collectors.nvml_types import GpuRecord, NvmlSnapshot
from slurm_resilience.health.findings import (
    CheckResult,
    Finding,
    describe_identity,
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

# nvmlGpuRecoveryAction_t
RECOVERY_ACTIONS = {0: "NONE", 1: "GPU_RESET", 2: "NODE_REBOOT", 3: "DRAIN_P2P",
                    4: "DRAIN_AND_RESET", 5: "RECOVER_IMEX_DOMAIN", 6: "BUS_RESET",
                    7: "SYSTEM_REBOOT"}

# Re-exported for callers that read fabric states from here.
FABRIC_NOT_SUPPORTED = gpu_fabric.FABRIC_NOT_SUPPORTED
FABRIC_STATES = gpu_fabric.FABRIC_STATES
FABRIC_COMPLETED = gpu_fabric.FABRIC_COMPLETED


def _throttle(gpu: GpuRecord, subject: str, cfg: GpuCheckSection, streak: int,
              samples: list[float], now: float) -> tuple[list[Finding], int, list[float]]:
    """HW thermal slowdown fails at once (the GPU is protecting itself from heat); HW
    slowdown and power brake fail only when seen in throttle_fail_runs runs within
    throttle_window_s: one reading is often a PSU or power-capping transient.
    ``samples`` holds the times of the runs that saw them (only those, so a healthy
    run leaves the state, and the state file, untouched)."""
    reasons = gpu.throttle_reasons
    if reasons is None:
        return [], 0, samples
    out: list[Finding] = []
    if reasons & HW_THERMAL:
        out.append(fail(NAME, subject, f"{subject} HW thermal slowdown (expected none)"))
    kept = [t for t in samples if now - t <= cfg.throttle_window_s]
    if reasons & (HW_SLOWDOWN | HW_POWER_BRAKE) and not reasons & HW_THERMAL:
        kept = [*kept, now][-cfg.throttle_fail_runs:]
        what = "HW power brake slowdown" if reasons & HW_POWER_BRAKE else "HW slowdown"
        window = f"{cfg.throttle_window_s // 60}min"
        text = (f"{subject} {what} in {len(kept)} runs within {window} "
                f"(expected <{cfg.throttle_fail_runs})")
        judge = fail if len(kept) >= cfg.throttle_fail_runs else warn
        out.append(judge(NAME, subject, text, runs=len(kept)))
    streak = streak + 1 if reasons & SW_THERMAL else 0
    if streak >= cfg.sw_thermal_warn_runs:
        out.append(warn(NAME, subject, f"{subject} SW thermal slowdown for {streak} runs",
                        runs=streak))
    # Idle and SW power cap are normal operation and ignored.
    return out, streak, kept


def _pcie(gpu: GpuRecord, subject: str) -> list[Finding]:
    p = gpu.pcie
    out: list[Finding] = []
    if p.width is not None and p.width_max is not None and p.width < p.width_max:
        out.append(fail(NAME, subject, f"{subject} PCIe x{p.width} (expected x{p.width_max})"))
    idle = bool((gpu.throttle_reasons or 0) & IDLE)
    # An idle GPU may lower its link speed to save power; its width never drops.
    if p.gen is not None and p.gen_max is not None and p.gen < p.gen_max and not idle:
        out.append(fail(NAME, subject, f"{subject} PCIe gen{p.gen} (expected gen{p.gen_max})"))
    return out


def _nvlink(gpu: GpuRecord, subject: str, expected: int) -> list[Finding]:
    links = gpu.nvlink
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


def leftover_allowance(name: str | None, cfg: GpuCheckSection) -> int:
    for model, allowed in cfg.leftover_memory_by_model.items():
        if name and gpu_models.matches(model, name):
            return int(allowed)
    return int(cfg.leftover_memory)


def _leftovers(gpu: GpuRecord, subject: str, cfg: GpuCheckSection) -> list[Finding]:
    out: list[Finding] = []
    procs = gpu.processes
    if cfg.leftover_processes and procs:
        pids = ",".join(str(p.pid) for p in procs[:4])
        out.append(fail(NAME, subject, f"{subject} {len(procs)} leftover process(es) "
                                       f"pid {pids} (expected none)"))
    used = gpu.memory_used_bytes
    allowed = leftover_allowance(gpu.name, cfg)
    if used is not None and used > allowed:
        how = "" if gpu.memory_info_version == 2 else " (NVML v1: includes reserved)"
        out.append(fail(NAME, subject, f"{subject} {human_size(used)} memory in use{how} "
                                       f"(expected <{human_size(allowed)})"))
    return out


def _recovery(gpu: GpuRecord, subject: str, cfg: GpuCheckSection) -> list[Finding]:
    action = gpu.recovery_action
    if not cfg.recovery_action or action is None or action == 0:
        return []
    name = RECOVERY_ACTIONS.get(action, str(action))
    return [fail(NAME, subject, f"{subject} NVML recovery action {name} (expected NONE)",
                 recovery_action=name)]


def _sram(gpu: GpuRecord, subject: str, cfg: GpuCheckSection, prev: dict[str, Any],
          now: float) -> list[Finding]:
    s = gpu.sram_ecc
    if s is None:
        return []
    out: list[Finding] = []
    if cfg.max_sram_uncorrectable >= 0 and s.aggregate_uncorrected > cfg.max_sram_uncorrectable:
        out.append(fail(NAME, subject, f"{subject} {s.aggregate_uncorrected} SRAM uncorrectable "
                                       f"errors (expected <={cfg.max_sram_uncorrectable})"))
    if cfg.fail_on_sram_threshold and s.threshold_exceeded:
        out.append(fail(NAME, subject, f"{subject} SRAM error threshold exceeded "
                                       "(expected not; replace the GPU)"))
    before, then = prev.get("sram_cor"), prev.get("t")
    if isinstance(before, int) and isinstance(then, (int, float)) and now > then \
            and s.aggregate_corrected >= before:
        per_hour = (s.aggregate_corrected - before) / ((now - then) / 3600.0)
        if per_hour > cfg.max_sram_correctable_per_hour:
            out.append(warn(NAME, subject, f"{subject} SRAM correctable {per_hour:.0f}/h "
                                           f"(expected <={cfg.max_sram_correctable_per_hour:g}/h)"))
    return out


def _counters(gpu: GpuRecord, subject: str, cfg: GpuCheckSection, prev: dict[str, Any],
              now: float) -> list[Finding]:
    """NVLink error totals, PCIe error totals and replays, corrected ECC, as rises since
    the previous run."""
    out: list[Finding] = []
    links = dict(gpu.nvlink_errors.items()) if gpu.nvlink_errors else {}
    before_links: dict[str, int] = prev.get("nvlink", {})
    for name, limit in sorted(cfg.max_nvlink_error_delta.items()):
        value, before = links.get(name), before_links.get(name)
        if value is None or before is None or value < before:
            continue  # first run, or the driver was reloaded: a new baseline
        if value - before > limit:
            out.append(fail(NAME, subject, f"{subject} NVLink {name} errors +{value - before} "
                                           f"(expected <={limit})"))
    aer, before_aer = gpu.pcie_aer or {}, prev.get("pcie_aer") or {}
    source = _aer_source(gpu.pcie_aer, gpu.pcie_aer_source)
    if source != _aer_source(prev.get("pcie_aer"), prev.get("pcie_aer_source")):
        before_aer = {}  # sysfs and NVML count differently: a new baseline, not a rise
    for name, limit in sorted(cfg.max_pcie_aer_delta.items()):
        value, was = aer.get(name), before_aer.get(name)
        if value is not None and was is not None and value >= was and value - was > limit:
            text = (f"PCIe AER {name} +{value - was} (expected <={limit})"
                    if source == "sysfs" else
                    f"PCIe {name} errors +{value - was} (NVML counter; expected <={limit})")
            out.append(fail(NAME, subject, f"{subject} {text}"))
    cor, was_cor, then = gpu.ecc_aggregate_corrected, prev.get("ecc_cor"), prev.get("t")
    if cor is not None and isinstance(was_cor, int) and isinstance(then, (int, float)) \
            and now > then and cor >= was_cor:
        per_hour = (cor - was_cor) / (max(now - then, 60.0) / 3600.0)
        if per_hour > cfg.max_ecc_corrected_per_hour:
            out.append(fail(NAME, subject, f"{subject} ECC corrected {per_hour:.0f}/h "
                                           f"(expected <={cfg.max_ecc_corrected_per_hour:g}/h; "
                                           "degrading memory)"))
    replay, before, then = gpu.pcie.replay, prev.get("pcie_replay"), prev.get("t")
    if replay is not None and isinstance(before, int) and isinstance(then, (int, float)) \
            and now > then and replay >= before:
        minutes = max((now - then) / 60.0, 1.0)
        allowed = cfg.max_pcie_replays_per_min * minutes
        if replay - before > allowed:
            out.append(fail(NAME, subject, f"{subject} PCIe replays +{replay - before} in "
                                           f"{minutes:.0f}min (expected <={allowed:.0f})"))
    return out


def _aer_source(totals: Any, source: Any) -> str | None:
    """Where PCIe error totals came from. State (or a record) from before NVML could be
    the source names none, and its totals were sysfs AER."""
    return str(source) if source else ("sysfs" if totals else None)


def _baseline(gpu: GpuRecord, now: float, prev: dict[str, Any]) -> dict[str, Any]:
    """Counter values to compare the next run with. Unchanged counters keep the old
    baseline and its time: rates then span longer, and a quiet run writes no state."""
    values = {"nvlink": dict(gpu.nvlink_errors.items()) if gpu.nvlink_errors else {},
              "pcie_replay": gpu.pcie.replay, "pcie_aer": gpu.pcie_aer,
              "pcie_aer_source": _aer_source(gpu.pcie_aer, gpu.pcie_aer_source),
              "ecc_cor": gpu.ecc_aggregate_corrected,
              "sram_cor": gpu.sram_ecc.aggregate_corrected if gpu.sram_ecc else None}
    was = {**prev, "pcie_aer_source": _aer_source(prev.get("pcie_aer"),
                                                  prev.get("pcie_aer_source"))}
    if prev.get("t") is not None and all(was.get(k) == v for k, v in values.items()):
        return prev
    return {"t": now, **values}


def _memory_errors(gpu: GpuRecord, subject: str, cfg: GpuCheckSection) -> list[Finding]:
    out: list[Finding] = []
    vol = gpu.ecc_volatile_uncorrected
    if vol is not None and vol > cfg.max_volatile_uncorrectable_ecc:
        out.append(fail(NAME, subject, f"{subject} {vol} uncorrectable ECC errors "
                                       f"(expected <={cfg.max_volatile_uncorrectable_ecc})"))
    agg = gpu.ecc_aggregate_uncorrected
    if cfg.max_aggregate_uncorrectable_ecc >= 0 and agg is not None \
            and agg > cfg.max_aggregate_uncorrectable_ecc:
        out.append(fail(NAME, subject, f"{subject} {agg} lifetime uncorrectable ECC errors "
                                       f"(expected <={cfg.max_aggregate_uncorrectable_ecc})"))
    retired = gpu.retired_pages
    if retired is not None and retired > cfg.max_retired_pages:
        out.append(fail(NAME, subject, f"{subject} {retired} retired pages "
                                       f"(expected <={cfg.max_retired_pages})"))
    if cfg.fail_on_retired_pages_pending and gpu.retired_pending:
        out.append(fail(NAME, subject, f"{subject} page retirement pending (reset the GPU)"))
    remap = gpu.remap
    if remap is not None:
        if remap.failed:
            out.append(fail(NAME, subject, f"{subject} row remapping failed (replace the GPU)"))
        if remap.pending and cfg.fail_on_remap_pending:
            out.append(fail(NAME, subject, f"{subject} row remap pending (reset the GPU)"))
    return out


def _one_gpu(gpu: GpuRecord, cfg: GpuCheckSection, kind: str, state: dict[str, Any],
             job_gpus: frozenset[int] | None, now: float) -> tuple[list[Finding], dict[str, Any]]:
    subject = f"gpu{gpu.index}"
    if gpu.lost:
        return [fail(NAME, subject, f"{subject} lost (NVML GPU_IS_LOST; expected present)")], {}
    out: list[Finding] = []
    for field, err in sorted(gpu.errors.items()):
        out.append(unknown(NAME, subject, f"{subject} couldn't read {field}: NVML {err}"))
    out.extend(_memory_errors(gpu, subject, cfg))
    out.extend(_recovery(gpu, subject, cfg))
    out.extend(_sram(gpu, subject, cfg, state.get("counters", {}), now))
    out.extend(_counters(gpu, subject, cfg, state.get("counters", {}), now))
    found, streak, samples = _throttle(gpu, subject, cfg, int(state.get("streak", 0)),
                                       list(state.get("throttle", [])), now)
    out.extend(found)
    temp = gpu.temperature_c
    if temp is not None and temp > cfg.max_temperature_c:
        out.append(fail(NAME, subject, f"{subject} {temp}C (expected <={cfg.max_temperature_c}C)"))
    if cfg.check_pcie:
        out.extend(_pcie(gpu, subject))
    out.extend(_nvlink(gpu, subject, cfg.expected_nvlinks))
    # Another job may share the node: only the GPUs given to this job must be empty.
    if kind == "prolog" and (job_gpus is None or gpu.index in job_gpus):
        out.extend(_leftovers(gpu, subject, cfg))
    out.extend(gpu_fabric.check(NAME, gpu, subject, cfg.fabric_manager, cfg.fabric_health))
    if cfg.require_persistence_mode and gpu.persistence_mode is False:
        out.append(fail(NAME, subject, f"{subject} persistence mode off (expected on)"))
    if not out:
        out.append(ok(NAME, subject, f"{subject} ok", name=gpu.name, pci=gpu.pci_bus_id))
    return out, {"streak": streak, "throttle": samples,
                 "counters": _baseline(gpu, now, state.get("counters", {}))}


def _consistency(snap: NvmlSnapshot, cfg: GpuCheckSection) -> list[Finding]:
    """Node-wide: one VBIOS per model, the expected driver (aznhc, GCM)."""
    out: list[Finding] = []
    if cfg.expected_driver and snap.driver is not None \
            and not snap.driver.startswith(cfg.expected_driver):
        out.append(fail(NAME, "driver", f"driver {snap.driver} "
                                        f"(expected {cfg.expected_driver}*)"))
    if cfg.uniform_vbios != "off":
        judge = fail if cfg.uniform_vbios == "fail" else warn
        by_model: dict[str, dict[str, list[int]]] = {}
        for g in snap.gpus:
            if g.vbios and g.name:
                by_model.setdefault(g.name, {}).setdefault(g.vbios, []).append(g.index)
        for model, versions in sorted(by_model.items()):
            if len(versions) > 1:
                common = max(versions, key=lambda v: len(versions[v]))
                odd = [f"gpu{i} {v}" for v, idx in sorted(versions.items()) if v != common
                       for i in idx]
                more = f" +{len(odd) - 2}" if len(odd) > 2 else ""
                out.append(judge(NAME, "vbios", f"{', '.join(odd[:2])}{more} VBIOS differs "
                                                f"from {model} peers (expected {common})"))
    return out


def _unsupported(snap: NvmlSnapshot) -> list[Finding]:
    """Say once per node which checks the GPUs or driver can't answer: a field that is
    NOT_SUPPORTED is neither a pass nor a failure."""
    names = sorted({u for g in snap.gpus if not g.lost for u in g.unsupported}
                   & {"recovery_action", "sram_ecc", "nvlink_replay", "pcie_replay",
                      "memory_v2", "pcie_aer"})
    if not names:
        return []
    return [ok(NAME, "support", f"not supported on these GPUs/driver {snap.driver}: "
                                f"{', '.join(names)} (not checked)", unsupported=names)]


def check(snap: NvmlSnapshot, cfg: GpuCheckSection, state: dict[str, Any], *,
          kind: str = "healthcheck", expected_count: int | None = None,
          job_gpus: frozenset[int] | None = None, now: float = 0.0) -> CheckResult:
    """Findings for every GPU, plus the count against what the node should have.

    ``expected_count`` comes from the job's gres when the config leaves it at -1.
    ``job_gpus`` (prolog): the GPU indices given to the job, the only ones checked for
    leftovers; None checks every GPU (a node without gpu gres runs whole-node jobs).
    ``now``: the caller's clock (epoch seconds), for windows and rates.
    """
    want = cfg.expected_count if cfg.expected_count >= 0 else expected_count
    if snap.no_driver:
        # No NVIDIA driver or library: a GPU-less node, unless it should have GPUs.
        if want:
            return CheckResult([fail(NAME, "count", f"0 GPUs visible, {snap.error} "
                                                    f"(expected {want})")], state)
        return CheckResult([ok(NAME, "nvml", f"no NVIDIA driver: no GPUs expected "
                                             f"({snap.error})")], state)
    if snap.error:
        return CheckResult([unknown(NAME, "nvml", f"nvml: {snap.error}")], state)
    findings: list[Finding] = []
    count = snap.count or 0
    prev: dict[str, Any] = state.get("gpus", {})
    legacy: dict[str, int] = state.get("sw_thermal_streak", {})
    keep: dict[str, Any] = {}
    for gpu in snap.gpus:
        key = gpu.uuid or str(gpu.index)
        before = dict(prev.get(key, {}))
        before.setdefault("streak", legacy.get(str(gpu.index), 0))
        found, kept = _one_gpu(gpu, cfg, kind, before, job_gpus, now)
        keep[key] = {**kept, **gpu.identity()} if kept else kept
        findings.extend(found)
    if want is not None and count < want:
        # The GPUs seen before and gone now, named as an RMA desk needs them; remembered
        # while the count stays short, so every later run still names them.
        gone = {k: v for k, v in prev.items() if k not in keep and isinstance(v, dict)
                and isinstance(v.get("index"), int)}
        keep.update(gone)
        named = "; ".join(describe_identity(v) for _, v in sorted(
            gone.items(), key=lambda kv: kv[1]["index"]))
        findings.append(fail(NAME, "count", f"{count} GPUs visible (expected {want}"
                                            + (f"; gone: {named})" if named else ")"),
                             gone=[dict(v) for v in gone.values()]))
    findings.extend(_consistency(snap, cfg))
    if cfg.peermem == "required" and snap.gpus and snap.peermem_loaded is not True:
        shown = "not loaded" if snap.peermem_loaded is False else "unknown (modules unreadable)"
        findings.append(fail(NAME, "peermem", f"nvidia_peermem {shown} (expected loaded)"))
    findings.extend(_unsupported(snap))
    if want is not None and count >= want:
        findings.append(ok(NAME, "count", f"{count} GPUs visible (expected {want})"))
    return CheckResult(findings, {"gpus": keep})
