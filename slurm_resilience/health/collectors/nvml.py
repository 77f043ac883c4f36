"""Read GPU health through NVML (``pynvml`` from nvidia-ml-py, imported only here).

The same code runs against the real ``pynvml`` or the scenario-driven stand-in
:mod:`slurm_resilience.fakes.nvml`, which implements the same call names,
constants and :class:`NVMLError` codes. Per field: NOT_SUPPORTED becomes None
(the SKU lacks it), GPU_IS_LOST marks the GPU lost, any other error is kept
by name so the check can say "could not check".
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from types import ModuleType
from typing import Any

_NOT_SUPPORTED = 3
# A driver older than the call answers FUNCTION_NOT_FOUND: as good as NOT_SUPPORTED.
_FUNCTION_NOT_FOUND = 13
_ABSENT = (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND)
_INVALID_ARGUMENT = 2
_GPU_IS_LOST = 15
# nvmlInit answers these on a machine without the NVIDIA driver or library.
_NO_DRIVER = (9, 12)


def load_module(backend: str, scenario_dir: str, node: str) -> ModuleType:
    """``pynvml``, or the stand-in loaded with this node's scenario."""
    if backend == "fake":
        from slurm_resilience.fakes import nvml as fake

        fake.use_scenario(fake.scenario_path(scenario_dir, node))
        return fake
    import pynvml

    module: ModuleType = pynvml
    return module


def _error_name(nv: ModuleType, exc: BaseException) -> str:
    value = getattr(exc, "value", None)
    for name in dir(nv):
        if name.startswith("NVML_ERROR_") and getattr(nv, name) == value:
            return name.removeprefix("NVML_ERROR_")
    return f"NVML error {value}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Gpu:
    """Reads one GPU's fields, recording what is unsupported, lost or failing."""

    def __init__(self, nv: ModuleType, handle: Any, record: dict[str, Any]):
        self.nv = nv
        self.handle = handle
        self.record = record

    def get(self, field: str, fn: Callable[..., Any], *args: Any) -> Any:
        if self.record["lost"]:
            return None
        try:
            return fn(self.handle, *args)
        except self.nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in _ABSENT:
                return None
            if code == _GPU_IS_LOST:
                self.record["lost"] = True
                return None
            self.record["errors"][field] = _error_name(self.nv, exc)
            return None


def _read_gpu(nv: ModuleType, index: int) -> dict[str, Any]:
    record: dict[str, Any] = {"index": index, "lost": False, "errors": {}}
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError as exc:
        if getattr(exc, "value", None) == _GPU_IS_LOST:
            record["lost"] = True
        else:
            record["errors"]["handle"] = _error_name(nv, exc)
        return record
    g = _Gpu(nv, handle, record)
    pci = g.get("pci", nv.nvmlDeviceGetPciInfo)
    record["pci_bus_id"] = _text(pci.busId) if pci is not None else None
    name = g.get("name", nv.nvmlDeviceGetName)
    record["name"] = _text(name) if name is not None else None
    uuid = g.get("uuid", nv.nvmlDeviceGetUUID)
    record["uuid"] = _text(uuid) if uuid is not None else None
    unc = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    record["ecc_volatile_uncorrected"] = g.get(
        "ecc_volatile", nv.nvmlDeviceGetTotalEccErrors, unc, nv.NVML_VOLATILE_ECC)
    record["ecc_aggregate_uncorrected"] = g.get(
        "ecc_aggregate", nv.nvmlDeviceGetTotalEccErrors, unc, nv.NVML_AGGREGATE_ECC)
    sbe = g.get("retired_sbe", nv.nvmlDeviceGetRetiredPages,
                nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    dbe = g.get("retired_dbe", nv.nvmlDeviceGetRetiredPages,
                nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    record["retired_pages"] = None if sbe is None or dbe is None else len(sbe) + len(dbe)
    pending = g.get("retired_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus)
    record["retired_pending"] = None if pending is None else bool(pending)
    remap = g.get("remapped_rows", nv.nvmlDeviceGetRemappedRows)
    record["remap"] = None if remap is None else {
        "correctable": int(remap[0]), "uncorrectable": int(remap[1]),
        "pending": bool(remap[2]), "failed": bool(remap[3])}
    record["throttle_reasons"] = g.get("throttle", nv.nvmlDeviceGetCurrentClocksThrottleReasons)
    record["temperature_c"] = g.get("temperature", nv.nvmlDeviceGetTemperature,
                                    nv.NVML_TEMPERATURE_GPU)
    record["pcie"] = {
        "gen": g.get("pcie_gen", nv.nvmlDeviceGetCurrPcieLinkGeneration),
        "gen_max": g.get("pcie_gen_max", nv.nvmlDeviceGetMaxPcieLinkGeneration),
        "width": g.get("pcie_width", nv.nvmlDeviceGetCurrPcieLinkWidth),
        "width_max": g.get("pcie_width_max", nv.nvmlDeviceGetMaxPcieLinkWidth),
    }
    record["nvlink"] = _nvlinks(nv, handle, record)
    procs = g.get("processes", nv.nvmlDeviceGetComputeRunningProcesses)
    record["processes"] = None if procs is None else [
        {"pid": int(p.pid), "used_bytes": int(p.usedGpuMemory or 0)} for p in procs]
    mem = g.get("memory", nv.nvmlDeviceGetMemoryInfo)
    record["memory_used_bytes"] = None if mem is None else int(mem.used)
    record["fabric"] = _fabric(nv, g)
    return record


def _nvlinks(nv: ModuleType, handle: Any, record: dict[str, Any]) -> list[bool] | None:
    """Active state of each link NVML reports; None on GPUs without NVLink."""
    states: list[bool] = []
    if record["lost"]:
        return None
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        try:
            states.append(bool(nv.nvmlDeviceGetNvLinkState(handle, link)))
        except nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in (*_ABSENT, _INVALID_ARGUMENT):
                break  # past the last link this GPU has
            if code == _GPU_IS_LOST:
                record["lost"] = True
                return None
            record["errors"]["nvlink"] = _error_name(nv, exc)
            break
    return states or None


def _fabric(nv: ModuleType, g: _Gpu) -> dict[str, int] | None:
    """NVSwitch fabric registration (Hopper and later); None where NVML lacks it."""
    info_type = getattr(nv, "c_nvmlGpuFabricInfo_t", None)
    if info_type is None or not hasattr(nv, "nvmlDeviceGetGpuFabricInfo"):
        return None
    info = info_type()
    done = g.get("fabric", nv.nvmlDeviceGetGpuFabricInfo, ctypes.byref(info))
    if done is None:
        return None
    return {"state": int(info.state), "status": int(info.status)}


def collect(backend: str, scenario_dir: str, node: str) -> dict[str, Any]:
    """Snapshot: ``{"backend", "driver", "count", "gpus": [...], "error"}``."""
    snap: dict[str, Any] = {"backend": backend, "driver": None, "count": None, "gpus": [],
                            "error": None}
    try:
        nv = load_module(backend, scenario_dir, node)
    except ImportError as exc:
        snap["error"] = f"couldn't import pynvml (install the gpu extra): {exc}"
        return snap
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        snap["error"] = f"couldn't initialise NVML: {_error_name(nv, exc)}"
        snap["no_driver"] = getattr(exc, "value", None) in _NO_DRIVER
        return snap
    try:
        snap["driver"] = _text(nv.nvmlSystemGetDriverVersion())
        count = int(nv.nvmlDeviceGetCount())
        snap["count"] = count
        snap["gpus"] = [_read_gpu(nv, i) for i in range(count)]
    except nv.NVMLError as exc:
        snap["error"] = f"couldn't list GPUs: {_error_name(nv, exc)}"
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            snap.setdefault("warnings", []).append(f"nvmlShutdown: {_error_name(nv, exc)}")
    return snap
