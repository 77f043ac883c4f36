"""The NVML stand-in: same names and codes as pynvml, and faithful to real nvidia-smi captures."""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import inspect
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.config.health import GpuCheckSection
from slurm_resilience.fakes import nvml as fake
from slurm_resilience.fakes import nvml_captures
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
    return nvml_captures.scenario_from_nvidia_smi((SMI / name).read_text())


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
    findings = gpu_check.check(snap, GpuCheckSection(), gpu_check.GpuState(),
                               kind="healthcheck").findings
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
               for f in gpu_check.check(gh200, cfg, gpu_check.GpuState()).findings)


def test_sw_thermal_capture_warns_when_sustained(tmp_path: Path) -> None:
    """The capture with one GPU in SW thermal slowdown warns once it lasts."""
    snap = collect(tmp_path, smi(
        "nvidia-smi-q_h100-80gb-hbm3-x8_drv535.183_one-gpu-sw-thermal-powercap.txt"))
    state = gpu_check.GpuState()
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


# -- the real H200 capture (.ci/capture-gpu-outputs; tests/fixtures/SOURCES.md section 11) --

H200 = REAL_FIXTURES / "gpu-capture" / "h200-1gpu-vm_drv580.159.04"


def _capture(name: str) -> Any:
    return json.loads((H200 / name).read_text())


def _capture_node(tmp_path: Path) -> tuple[str, str]:
    """/proc/modules and the GPU's sysfs directory as facts.json recorded them (the files
    it could read; on that VM no aer_dev_* file), for the collector's modules_file and
    pci_root."""
    facts = _capture("facts.json")
    modules = tmp_path / "modules"
    modules.write_text("".join(f"{line}\n" for line in facts["nvidia_modules"]))
    pci = tmp_path / "pci"
    for bdf, files in facts["pci_nvidia"].items():
        (pci / bdf).mkdir(parents=True)
        for name, text in files.items():
            if not text.startswith("unreadable:"):
                (pci / bdf / name).write_text(text)
    return str(modules), str(pci)


def test_stand_in_loaded_from_the_raw_capture_gives_the_captured_snapshot(
        tmp_path: Path) -> None:
    """The collector against the stand-in with scenario_from_nvml_raw(nvml-raw.json) gives
    the snapshot the same collector took of the real H200 (nvml-snapshot.json)."""
    raw = _capture("nvml-raw.json")
    fake.write_scenario(str(tmp_path / "vm.json"), nvml_captures.scenario_from_nvml_raw(raw))
    modules, pci = _capture_node(tmp_path)
    got = collector.collect("fake", str(tmp_path), "vm", modules, pci).to_json()
    want = _capture("nvml-snapshot.json")
    # What the capture can't carry: which module answered (pynvml there), and what the
    # collector reads since it was taken: the PCIe error totals from NVML where sysfs has
    # no AER (this VM), whose answers nvml-raw.json holds; with them "pcie_aer" is no
    # longer unsupported; and the board serial (nvmlDeviceGetSerial, also in nvml-raw.json).
    assert (got.pop("backend"), want.pop("backend")) == ("fake", "nvml")
    for real, gpu in zip(raw["gpus"], want["gpus"], strict=True):
        fields = real["field_values"]
        gpu["pcie_aer"] = {key: fields[f"NVML_FI_DEV_PCIE_COUNT_{name}"]["value"]["uiVal"]
                           for key, name in (("correctable", "CORRECTABLE_ERRORS"),
                                             ("nonfatal", "NON_FATAL_ERROR"),
                                             ("fatal", "FATAL_ERROR"))}
        gpu["pcie_aer_source"] = "nvml"
        gpu["unsupported"].remove("pcie_aer")
        gpu["serial"] = real["nvmlDeviceGetSerial"]["value"]
        # and the NVLink domain's identity (fabric info V3: clusterUuid, cliqueId).
        fab = real["nvmlDeviceGetGpuFabricInfoV"]["value"]
        gpu["fabric"]["cluster_uuid"] = str(uuid.UUID(bytes=bytes(fab["clusterUuid"][:16])))
        gpu["fabric"]["clique_id"] = fab["cliqueId"]
    assert got == want
    assert got["gpus"][0]["pcie_aer"] == {"correctable": 0, "nonfatal": 0, "fatal": 0}


def _plain(value: Any) -> Any:
    """A stand-in answer in the capture's JSON shapes (ctypes, dataclasses, bytes)."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, ctypes.Structure | ctypes.Union):
        return {name: _plain(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, ctypes.Array | list | tuple):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    return value


def _answer(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        return {"value": _plain(fn(*args, **kwargs))}
    except fake.NVMLError as exc:
        return {"error": exc.value}


def _same(real: dict[str, Any], ours: dict[str, Any], what: str) -> None:
    """The same NVML return code and, for a value, the same value (a structure: each of
    the capture's fields; clusterUuid is left out: zeros on this GPU, and recorded with
    80 entries in fabric info v1 by the capture's nvidia-ml-py 13.610.43 where nvml.h
    has NVML_GPU_FABRIC_UUID_LEN 16)."""
    assert real.get("error", 0) == ours.get("error", 0), what
    if "value" not in real:
        return
    want, got = real["value"], ours["value"]
    if isinstance(want, dict):
        want = {k: v for k, v in want.items() if k != "clusterUuid"}
        got = {k: got[k] for k in want if k in got}
    assert got == want, what


def test_stand_in_answers_every_collector_call_as_the_real_h200(tmp_path: Path) -> None:
    """Each NVML call of nvml-raw.json that the collector makes, made of the stand-in
    loaded with scenario_from_nvml_raw: the same NVMLError code (NOT_SUPPORTED for retired
    pages and every NVLink state on this SKU, INVALID_ARGUMENT past the last GPU) or the
    same value; each field value the same nvmlReturn and, where it answered, the same
    type and value."""
    _answers_as_recorded(tmp_path, _capture("nvml-raw.json"))


def test_raw_capture_errors_other_than_not_supported_are_answered_alike(
        tmp_path: Path) -> None:
    """A capture where calls failed otherwise (TIMEOUT, a field's own UNKNOWN, a VBIOS
    NOT_SUPPORTED) gives a scenario answering those codes too."""
    raw = _capture("nvml-raw.json")
    gpu = raw["gpus"][0]
    gpu["nvmlDeviceGetTemperature_gpu"] = {"error": 10, "error_name": "TIMEOUT"}
    gpu["nvmlDeviceGetVbiosVersion"] = {"error": 3, "error_name": "NOT_SUPPORTED"}
    gpu["field_values"]["NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"]["nvmlReturn"] = 999
    scenario = _answers_as_recorded(tmp_path, raw)
    assert scenario["gpus"][0]["errors"] == {"nvmlDeviceGetTemperature": "TIMEOUT"}


def _answers_as_recorded(tmp_path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    scenario = nvml_captures.scenario_from_nvml_raw(raw)
    fake.write_scenario(str(tmp_path / "vm.json"), scenario)
    fake.use_scenario(str(tmp_path / "vm.json"))
    unc, cor = fake.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, fake.NVML_MEMORY_ERROR_TYPE_CORRECTED
    vol, agg = fake.NVML_VOLATILE_ECC, fake.NVML_AGGREGATE_ECC
    calls: dict[str, tuple[str, tuple[Any, ...], dict[str, Any]]] = {
        name: (name, (), {}) for name in (
            "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetSerial",
            "nvmlDeviceGetPciInfo",
            "nvmlDeviceGetVbiosVersion", "nvmlDeviceGetPersistenceMode",
            "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetCurrPcieLinkGeneration",
            "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
            "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetMemoryInfo")}
    calls |= {
        "nvmlDeviceGetMemoryInfo_v2": ("nvmlDeviceGetMemoryInfo", (),
                                       {"version": fake.nvmlMemory_v2}),
        "nvmlDeviceGetTemperature_gpu": ("nvmlDeviceGetTemperature",
                                         (fake.NVML_TEMPERATURE_GPU,), {}),
        "nvmlDeviceGetRetiredPages_sbe": (
            "nvmlDeviceGetRetiredPages",
            (fake.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,), {}),
        "nvmlDeviceGetRetiredPages_dbe": (
            "nvmlDeviceGetRetiredPages", (fake.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,),
            {}),
        **{f"nvmlDeviceGetTotalEccErrors_{e}_{c}": ("nvmlDeviceGetTotalEccErrors", (et, ct), {})
           for e, et in (("uncorrected", unc), ("corrected", cor))
           for c, ct in (("volatile", vol), ("aggregate", agg))},
    }
    structs = {"nvmlDeviceGetSramEccErrorStatus": fake.c_nvmlEccSramErrorStatus_v1_t,
               "nvmlDeviceGetGpuFabricInfoV": fake.c_nvmlGpuFabricInfo_v3_t,
               "nvmlDeviceGetGpuFabricInfo": fake.c_nvmlGpuFabricInfo_t}
    # Every call the collector makes is compared here.
    tree = ast.parse(inspect.getsource(collector))
    made = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and node.attr.startswith(("nvmlDevice", "nvmlSystem", "nvmlInit", "nvmlShutdown"))}
    compared = {fn for fn, _, _ in calls.values()} | set(structs) | {
        "nvmlInit", "nvmlShutdown", "nvmlSystemGetDriverVersion", "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetFieldValues"}
    assert made <= compared, made - compared

    _same(raw["init"], _answer(fake.nvmlInit), "nvmlInit")
    for fn in ("nvmlSystemGetDriverVersion", "nvmlDeviceGetCount"):
        _same(raw["system"][fn], _answer(getattr(fake, fn)), fn)
    count = raw["system"]["nvmlDeviceGetCount"]["value"]
    _same(raw["handle_past_last"], _answer(fake.nvmlDeviceGetHandleByIndex, count), "past last")
    for index, real in enumerate(raw["gpus"]):
        h = fake.nvmlDeviceGetHandleByIndex(index)
        for key, (fn, args, kwargs) in calls.items():
            _same(real[key], _answer(getattr(fake, fn), h, *args, **kwargs), key)
        for fn, kind in structs.items():
            status = kind()
            got = _answer(getattr(fake, fn), h, ctypes.byref(status))
            _same(real[fn], {"value": _plain(status)} if "value" in got else got, fn)
        assert len(real["nvlink"]) == fake.NVML_NVLINK_MAX_LINKS + 1
        for link, answers in enumerate(real["nvlink"]):
            _same(answers["state"], _answer(fake.nvmlDeviceGetNvLinkState, h, link),
                  f"nvlink {link}")
        names = list(real["field_values"])
        values = fake.nvmlDeviceGetFieldValues(h, [getattr(fake, n) for n in names])
        assert set(collector._FIELDS.values()) <= set(names)  # those the collector asks
        for name, ours in zip(names, values, strict=True):
            want = real["field_values"][name]
            assert ours.nvmlReturn == want["nvmlReturn"], name
            if want["nvmlReturn"] == fake.NVML_SUCCESS:
                assert ours.valueType == want["valueType"], name
                assert _plain(ours.value) == want["value"], name
    _same(raw["shutdown"], _answer(fake.nvmlShutdown), "nvmlShutdown")
    return scenario
