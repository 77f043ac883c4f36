"""GPU checks: each condition fails when it should and passes when healthy."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from slurm_resilience.config.health import GpuCheckSection
from slurm_resilience.health.checks import gpu
from slurm_resilience.health.collectors.nvml_types import NvmlSnapshot
from slurm_resilience.health.findings import Severity


def healthy_gpu(index: int = 0) -> dict[str, Any]:
    return {
        "index": index, "lost": False, "errors": {}, "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"00000000:{0x18 + index:02X}:00.0", "uuid": f"GPU-{index}",
        "ecc_volatile_uncorrected": 0, "ecc_aggregate_uncorrected": 0,
        "retired_pages": None, "retired_pending": None,
        "remap": {"correctable": 0, "uncorrectable": 0, "pending": False, "failed": False},
        "throttle_reasons": gpu.IDLE, "temperature_c": 30,
        "pcie": {"gen": 5, "gen_max": 5, "width": 16, "width_max": 16},
        "nvlink": [True] * 18, "processes": [], "memory_used_bytes": 1 << 20,
        "fabric": {"state": 3, "status": 0}, "memory_info_version": 2,
        "persistence_mode": True, "vbios": "96.00.74.00.01", "recovery_action": 0,
    }


def snap(gpus: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    gpus = gpus if gpus is not None else [healthy_gpu(i) for i in range(8)]
    return {"backend": "nvml", "driver": "565.57.01", "count": len(gpus), "gpus": gpus,
            "error": None}


def run(s: dict[str, Any], cfg: GpuCheckSection | None = None, kind: str = "healthcheck",
        state: gpu.GpuState | None = None, expected: int | None = None
        ) -> tuple[list[Any], gpu.GpuState]:
    result = gpu.check(NvmlSnapshot.from_json(s), cfg or GpuCheckSection(), state or gpu.GpuState(),
                       kind=kind, expected_count=expected, now=1000.0)
    return result.findings, result.state


def fails(findings: list[Any]) -> list[str]:
    return [f.message for f in findings if f.severity is Severity.FAIL]


def with_gpu3(**changes: Any) -> dict[str, Any]:
    s = snap()
    g = copy.deepcopy(s["gpus"][3])
    g.update(changes)
    s["gpus"][3] = g
    return s


def test_healthy_node_passes_every_gpu_check() -> None:
    """Eight healthy GPUs give only OK findings, including in the prolog."""
    findings, _ = run(snap(), kind="prolog", expected=8)
    assert not fails(findings)
    assert all(f.severity is Severity.OK for f in findings)


def test_count_below_expected_fails() -> None:
    """Seven GPUs where eight are expected is a failure naming both numbers."""
    s = snap([healthy_gpu(i) for i in range(7)])
    assert fails(run(s, expected=8)[0]) == ["7 GPUs visible (expected 8)"]
    assert fails(run(s, GpuCheckSection(expected_count=8))[0]) == ["7 GPUs visible (expected 8)"]
    assert not fails(run(s, GpuCheckSection(expected_count=7))[0])


def test_lost_gpu_fails() -> None:
    """A GPU NVML reports lost fails with GPU_IS_LOST."""
    msgs = fails(run(with_gpu3(lost=True))[0])
    assert msgs == ["gpu3 lost (NVML GPU_IS_LOST; expected present)"]


def test_volatile_uncorrectable_ecc_fails_over_threshold() -> None:
    """One volatile uncorrectable ECC error fails by default and passes a threshold of 1."""
    s = with_gpu3(ecc_volatile_uncorrected=1)
    assert fails(run(s)[0]) == ["gpu3 1 uncorrectable ECC errors (expected <=0)"]
    assert not fails(run(s, GpuCheckSection(max_volatile_uncorrectable_ecc=1))[0])


def test_aggregate_ecc_only_when_configured() -> None:
    """Lifetime uncorrectable errors are ignored unless a threshold is set."""
    s = with_gpu3(ecc_aggregate_uncorrected=2)
    assert not fails(run(s)[0])
    assert fails(run(s, GpuCheckSection(max_aggregate_uncorrectable_ecc=1))[0])


def test_retired_pages_pending_or_over_count_fail() -> None:
    """Pending page retirement fails, as does a retired page count over the limit."""
    assert fails(run(with_gpu3(retired_pages=1, retired_pending=True))[0]) == [
        "gpu3 page retirement pending (reset the GPU)"]
    assert fails(run(with_gpu3(retired_pages=61, retired_pending=False))[0]) == [
        "gpu3 61 retired pages (expected <=60)"]
    assert not fails(run(with_gpu3(retired_pages=60, retired_pending=False))[0])


def test_row_remap_pending_and_failed_fail() -> None:
    """Row remapping pending or failed is a failure; correctable remaps alone are not."""
    pending = {"correctable": 0, "uncorrectable": 1, "pending": True, "failed": False}
    failed = {"correctable": 0, "uncorrectable": 1, "pending": False, "failed": True}
    done = {"correctable": 1, "uncorrectable": 1, "pending": False, "failed": False}
    assert fails(run(with_gpu3(remap=pending))[0]) == ["gpu3 row remap pending (reset the GPU)"]
    assert fails(run(with_gpu3(remap=failed))[0]) == [
        "gpu3 row remapping failed (replace the GPU)"]
    assert not fails(run(with_gpu3(remap=done))[0])


def test_one_hw_thermal_reading_fails() -> None:
    """A single HW thermal slowdown (thermal emergency) reading still fails at once."""
    assert fails(run(with_gpu3(throttle_reasons=gpu.HW_SLOWDOWN | gpu.HW_THERMAL))[0]) == [
        "gpu3 HW thermal slowdown (expected none)"]


@pytest.mark.parametrize(("bits", "what"), [
    (gpu.HW_SLOWDOWN | gpu.HW_POWER_BRAKE, "HW power brake slowdown"),
    (gpu.HW_SLOWDOWN, "HW slowdown"),
])
def test_hw_slowdown_is_judged_as_a_rate(bits: int, what: str) -> None:
    """One HW slowdown or power brake sample only warns; the third within the window
    fails; samples older than the window drop out."""
    s, cfg = with_gpu3(throttle_reasons=bits), GpuCheckSection()
    state = gpu.GpuState()
    results = []
    for t in (0.0, 60.0, 120.0):
        r = gpu.check(NvmlSnapshot.from_json(s), cfg, state, now=t)
        state = r.state
        results.append(r)
    assert not fails(results[0].findings)
    assert [f.message for f in results[0].findings if f.severity is Severity.WARN] == [
        f"gpu3 {what} in 1 runs within 60min (expected <3)"]
    assert fails(results[2].findings) == [f"gpu3 {what} in 3 runs within 60min (expected <3)"]
    # Two hours later the earlier samples are out of the window: one reading warns again.
    r = gpu.check(NvmlSnapshot.from_json(s), cfg, state, now=120.0 + 7200)
    assert not fails(r.findings)
    # A healthy run leaves the state as it was (nothing to write on the prolog path).
    healthy = gpu.check(NvmlSnapshot.from_json(snap()), cfg, state, now=8000.0)
    assert healthy.state == gpu.check(NvmlSnapshot.from_json(snap()), cfg, healthy.state,
                                      now=9000.0).state


def test_idle_and_sw_power_cap_are_ignored() -> None:
    """Idle and SW power cap throttling are normal operation."""
    findings, _ = run(with_gpu3(throttle_reasons=gpu.IDLE | gpu.SW_POWER_CAP))
    assert all(f.severity is Severity.OK for f in findings)


def test_sustained_sw_thermal_warns_after_n_runs() -> None:
    """SW thermal slowdown warns only once it has lasted sw_thermal_warn_runs runs."""
    s = with_gpu3(throttle_reasons=gpu.SW_THERMAL)
    state = gpu.GpuState()
    severities = []
    for _ in range(3):
        findings, state = run(s, state=state)
        severities.append(max(f.severity for f in findings))
    assert severities == [Severity.OK, Severity.OK, Severity.WARN]
    findings, state = run(snap(), state=state)
    assert state.gpus["GPU-3"].streak == 0


def test_temperature_over_limit_fails() -> None:
    """A GPU hotter than max_temperature_c fails."""
    assert fails(run(with_gpu3(temperature_c=91))[0]) == ["gpu3 91C (expected <=85C)"]
    assert not fails(run(with_gpu3(temperature_c=85))[0])


def test_pcie_width_or_generation_below_max_fails() -> None:
    """A narrower link fails; a slower one fails unless the GPU is idle."""
    narrow = {"gen": 5, "gen_max": 5, "width": 8, "width_max": 16}
    slow = {"gen": 3, "gen_max": 5, "width": 16, "width_max": 16}
    assert fails(run(with_gpu3(pcie=narrow))[0]) == ["gpu3 PCIe x8 (expected x16)"]
    assert not fails(run(with_gpu3(pcie=slow, throttle_reasons=gpu.IDLE))[0])
    assert fails(run(with_gpu3(pcie=slow, throttle_reasons=0))[0]) == [
        "gpu3 PCIe gen3 (expected gen5)"]


def test_inactive_nvlinks_fail() -> None:
    """Inactive NVLinks fail against every-link or a configured count."""
    links = [True] * 18
    links[4] = False
    assert fails(run(with_gpu3(nvlink=links))[0]) == [
        "gpu3 NVLink 17/18 active (expected 18; down: 4)"]
    assert not fails(run(with_gpu3(nvlink=links), GpuCheckSection(expected_nvlinks=17))[0])
    assert not fails(run(with_gpu3(nvlink=links), GpuCheckSection(expected_nvlinks=0))[0])


def test_leftover_processes_and_memory_fail_in_prolog_only() -> None:
    """Processes or memory left on a GPU fail in the prolog, not in the healthcheck."""
    s = with_gpu3(processes=[{"pid": 4242, "used_bytes": 2 << 30}], memory_used_bytes=2 << 30)
    assert fails(run(s, kind="prolog")[0]) == [
        "gpu3 1 leftover process(es) pid 4242 (expected none)",
        "gpu3 2.0GiB memory in use (expected <1.0GiB)"]
    assert not fails(run(s, kind="healthcheck")[0])


def test_fabric_manager_state() -> None:
    """A fabric not COMPLETED fails; GPUs without fabric support pass unless required."""
    assert fails(run(with_gpu3(fabric={"state": 2, "status": 0}))[0]) == [
        "gpu3 fabric IN_PROGRESS (expected COMPLETED; is nvidia-fabricmanager running?)"]
    assert not fails(run(with_gpu3(fabric=None))[0])
    assert fails(run(with_gpu3(fabric=None), GpuCheckSection(fabric_manager="required"))[0])
    assert not fails(run(with_gpu3(fabric={"state": 2, "status": 0}),
                         GpuCheckSection(fabric_manager="off"))[0])


def test_nvml_errors_are_could_not_check() -> None:
    """A field NVML fails to read (other than NOT_SUPPORTED) is reported as unknown."""
    findings, _ = run(with_gpu3(errors={"temperature": "TIMEOUT"}))
    assert [f.message for f in findings if f.severity is Severity.UNKNOWN] == [
        "gpu3 couldn't read temperature: NVML TIMEOUT"]
    findings, _ = run({"error": "couldn't initialise NVML: UNKNOWN", "gpus": []})
    assert findings[0].severity is Severity.UNKNOWN


def test_no_driver_is_a_gpu_less_node_unless_gpus_expected() -> None:
    """No NVIDIA driver passes when no GPUs are expected and fails when they are."""
    s = {"error": "couldn't initialise NVML: DRIVER_NOT_LOADED", "no_driver": True, "gpus": []}
    assert not fails(run(s)[0])
    assert fails(run(s, expected=8)[0])


def test_leftovers_are_only_checked_on_the_jobs_gpus() -> None:
    """On a shared node, another job's processes on GPUs not given to this job are fine."""
    s = with_gpu3(processes=[{"pid": 4242, "used_bytes": 2 << 30}], memory_used_bytes=2 << 30)
    typed = NvmlSnapshot.from_json(s)
    result = gpu.check(typed, GpuCheckSection(), gpu.GpuState(), kind="prolog",
                       job_gpus=frozenset({0, 1}))
    assert not fails(result.findings)
    result = gpu.check(typed, GpuCheckSection(), gpu.GpuState(), kind="prolog",
                       job_gpus=frozenset({3}))
    assert len(fails(result.findings)) == 2
