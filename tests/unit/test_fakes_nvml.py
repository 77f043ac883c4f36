"""The NVML stand-in: same names and codes as pynvml, and faithful to real nvidia-smi captures."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.config.health import GpuCheckSection
from slurm_resilience.fakes import nvml as fake
from slurm_resilience.health.checks import gpu as gpu_check
from slurm_resilience.health.collectors import nvml as collector
from slurm_resilience.health.collectors.nvml_types import NvmlSnapshot
from slurm_resilience.health.findings import Severity

SMI = REAL_FIXTURES / "nvidia-smi"
pynvml = pytest.importorskip("pynvml")


def collect(tmp_path: Path, scenario: dict[str, Any], node: str = "n1") -> NvmlSnapshot:
    fake.write_scenario(str(tmp_path / f"{node}.json"), scenario)
    return collector.collect("fake", str(tmp_path), node)


def smi(name: str) -> dict[str, Any]:
    return fake.scenario_from_nvidia_smi((SMI / name).read_text())


def test_constants_and_error_codes_match_pynvml() -> None:
    """Every NVML constant of the stand-in has pynvml's value."""
    names = [n for n in dir(fake) if n.startswith(("NVML_", "nvmlClocksThrottleReason"))]
    assert len(names) > 40
    for name in names:
        assert getattr(fake, name) == getattr(pynvml, name), name


def test_every_call_the_collector_makes_exists_in_pynvml() -> None:
    """The collector only calls pynvml functions that the stand-in also implements."""
    tree = ast.parse(inspect.getsource(collector))
    called = {node.attr for node in ast.walk(tree)
              if isinstance(node, ast.Attribute)
              and node.attr.startswith(("nvmlDevice", "nvmlSystem", "nvmlInit", "nvmlShutdown"))}
    assert "nvmlDeviceGetRemappedRows" in called
    for name in called:
        assert callable(getattr(pynvml, name)), name
        assert callable(getattr(fake, name)), name
    for name in ("nvmlDeviceGetFieldValues", "nvmlDeviceGetSramEccErrorStatus",
                 "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetPersistenceMode"):
        assert name in called, name


def test_structures_have_pynvml_layouts() -> None:
    """The stand-in's ctypes structures have pynvml's field names, in order, and versions."""
    for name in ("c_nvmlGpuFabricInfo_v3_t", "c_nvmlEccSramErrorStatus_v1_t",
                 "c_nvmlFieldValue_t", "c_nvmlValue_t"):
        ours = [f[0] for f in getattr(fake, name)._fields_]
        theirs = [f[0] for f in getattr(pynvml, name)._fields_]
        assert ours == theirs, name
    for name in ("nvmlMemory_v2", "nvmlGpuFabricInfo_v3", "nvmlEccSramErrorStatus_v1"):
        assert getattr(fake, name) == getattr(pynvml, name), name


def test_error_objects_behave_like_pynvml() -> None:
    """NVMLError carries .value and pynvml's message."""
    err = fake.NVMLError(fake.NVML_ERROR_GPU_IS_LOST)
    assert err.value == 15 and str(err) == str(pynvml.NVMLError(15))
    assert fake.error_code("NOT_SUPPORTED") == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_default_scenario_matches_the_real_healthy_h100_capture(tmp_path: Path) -> None:
    """The sandbox's default GPUs read like the real 8x H100 ``nvidia-smi -q`` capture."""
    real = collect(tmp_path, smi("nvidia-smi-q_h100-sxm-80gb-x8_drv565_healthy.txt"), "real")
    ours = collect(tmp_path, fake.default_scenario(), "ours")
    assert real.count == ours.count == 8
    for r, o in zip(real.gpus, ours.gpus, strict=True):
        for key in ("name", "pci_bus_id", "ecc_volatile_uncorrected", "retired_pages",
                    "retired_pending", "remap", "throttle_reasons", "fabric", "vbios",
                    "persistence_mode", "memory_reserved_bytes", "memory_info_version",
                    "recovery_action", "sram_ecc", "ecc_aggregate_corrected"):
            assert getattr(r, key) == getattr(o, key), key
        assert (r.pcie.gen, r.pcie.width) == (o.pcie.gen, o.pcie.width)
    assert ours.gpus[0].retired_pages is None  # Hopper: NOT_SUPPORTED, "N/A" in smi


@pytest.mark.parametrize(("capture", "expected"), [
    ("nvidia-smi-q_h100-sxm-80gb-x8_drv565_healthy.txt", []),
    ("nvidia-smi-q_h100-nvl-x2_drv550_healthy.txt", []),
    ("nvidia-smi-q_h200_drv550_healthy.txt", []),
    ("nvidia-smi-q_a100-sxm4-80gb-x4_drv555_remap-pending_dram-ce.txt",
     ["gpu? row remap pending (reset the GPU)"]),
    # One power brake reading is a warning now; it fails once frequent (see the rate test).
    ("nvidia-smi-q_h100-80gb-hbm3-x8_drv535.161_hw-power-brake-slowdown.txt", []),
    ("nvidia-smi-q_v100-sxm2-16gb-x8_drv550_retired-page-sbe.txt", []),
])
def test_real_captures_give_the_documented_verdict(tmp_path: Path, capture: str,
                                                   expected: list[str]) -> None:
    """Collector + check on a scenario built from each real capture find what it shows."""
    snap = collect(tmp_path, smi(capture))
    findings = gpu_check.check(snap, GpuCheckSection(), {}, kind="healthcheck").findings
    got = [f.message for f in findings if f.severity is Severity.FAIL]
    assert [m.replace(m.split()[0], "gpu?", 1) for m in got] == expected


def test_real_captures_detail(tmp_path: Path) -> None:
    """Specific GPUs of the real captures: remap pending on 9E, one retired page, DRAM UE."""
    a100 = collect(tmp_path, smi("nvidia-smi-q_a100-sxm4-80gb-x4_drv555_remap-pending_dram-ce.txt"))
    pending = [g.pci_bus_id for g in a100.gpus if g.remap and g.remap.pending]
    assert pending == ["00000000:9E:00.0"]
    v100 = collect(tmp_path, smi("nvidia-smi-q_v100-sxm2-16gb-x8_drv550_retired-page-sbe.txt"))
    assert [g.retired_pages for g in v100.gpus].count(1) == 1
    gh200 = collect(tmp_path, smi("nvidia-smi-q_gh200-480gb_drv550_dram-ue-remapped-row.txt"))
    assert gh200.gpus[0].ecc_aggregate_uncorrected == 1
    cfg = GpuCheckSection(max_aggregate_uncorrectable_ecc=0)
    assert any(f.severity is Severity.FAIL
               for f in gpu_check.check(gh200, cfg, {}).findings)


def test_sw_thermal_capture_warns_when_sustained(tmp_path: Path) -> None:
    """The capture with one GPU in SW thermal slowdown warns once it lasts."""
    snap = collect(tmp_path, smi(
        "nvidia-smi-q_h100-80gb-hbm3-x8_drv535.183_one-gpu-sw-thermal-powercap.txt"))
    state: dict[str, Any] = {}
    for _ in range(3):
        result = gpu_check.check(snap, GpuCheckSection(), state)
        state = result.state
    warned = [f.message for f in result.findings if f.severity is Severity.WARN]
    assert len(warned) == 1 and "SW thermal slowdown for 3 runs" in warned[0]


def test_error_codes_from_scenario(tmp_path: Path) -> None:
    """Scenario errors reach the collector as NVML codes: lost, unsupported, other."""
    scen = fake.default_scenario(3)
    scen["gpus"][0]["lost"] = True
    scen["gpus"][1]["errors"] = {"nvmlDeviceGetTemperature": "NOT_SUPPORTED",
                                 "nvmlDeviceGetRemappedRows": "TIMEOUT"}
    scen["gpus"][2]["nvlinks_down"] = [5]
    snap = collect(tmp_path, scen)
    assert snap.gpus[0].lost is True
    assert snap.gpus[1].temperature_c is None and "temperature" in snap.gpus[1].unsupported
    assert snap.gpus[1].errors == {"remapped_rows": "TIMEOUT"}
    links = snap.gpus[2].nvlink or []
    assert links.count(False) == 1 and len(links) == 18


def test_missing_scenario_is_a_node_without_driver(tmp_path: Path) -> None:
    """No scenario file: nvmlInit fails with DRIVER_NOT_LOADED, as on a GPU-less node."""
    snap = collector.collect("fake", str(tmp_path), "nobody")
    assert snap.no_driver is True and "DRIVER_NOT_LOADED" in (snap.error or "")
