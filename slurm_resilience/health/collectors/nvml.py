"""Read GPU health through NVML (``pynvml`` from nvidia-ml-py, imported only here).

The same code runs against the real ``pynvml`` or the scenario-driven stand-in
configured by ``health.backend: fake`` (:data:`NVML_MODULES`), which implements the same call names,
constants and :class:`NVMLError` codes. Per field: NOT_SUPPORTED becomes None
(the SKU lacks it), GPU_IS_LOST marks the GPU lost, any other error is kept
by name so the check can say "could not check".
"""

from __future__ import annotations

import ctypes
import importlib
import os
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol, cast

from slurm_resilience.config.health import NVML_MODULES
from slurm_resilience.health.collectors.nvml_types import (
    Fabric,
    GpuProcess,
    GpuRecord,
    NvlinkErrors,
    NvmlSnapshot,
    Pcie,
    RemapRows,
    SramEcc,
)

_NOT_SUPPORTED = 3
# A driver older than the call answers FUNCTION_NOT_FOUND: as good as NOT_SUPPORTED.
_FUNCTION_NOT_FOUND = 13
_ABSENT = (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND)
_INVALID_ARGUMENT = 2
_GPU_IS_LOST = 15
# nvmlInit answers these on a machine without the NVIDIA driver or library.
_NO_DRIVER = (9, 12)


class Standin(Protocol):
    """What a configured stand-in adds to pynvml's interface: its scenario."""

    def use_scenario(self, path: str) -> None: ...

    def scenario_path(self, scenario_dir: str, node: str) -> str: ...


def load_module(backend: str, scenario_dir: str, node: str) -> ModuleType:
    """The module ``health.backend`` names (:data:`NVML_MODULES`): ``pynvml``, or a
    stand-in loaded with this node's scenario."""
    module = importlib.import_module(NVML_MODULES[backend])
    if backend != "nvml":
        standin = cast(Standin, module)
        standin.use_scenario(standin.scenario_path(scenario_dir, node))
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

    def __init__(self, nv: ModuleType, handle: Any, record: GpuRecord):
        self.nv = nv
        self.handle = handle
        self.record = record

    def get(self, field: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.record.lost:
            return None
        try:
            return fn(self.handle, *args, **kwargs)
        except self.nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in _ABSENT:
                self.record.unsupported.append(field)
                return None
            if code == _GPU_IS_LOST:
                self.record.lost = True
                return None
            self.record.errors[field] = _error_name(self.nv, exc)
            return None


def _read_gpu(nv: ModuleType, index: int) -> GpuRecord:
    record = GpuRecord(index=index)
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError as exc:
        if getattr(exc, "value", None) == _GPU_IS_LOST:
            record.lost = True
        else:
            record.errors["handle"] = _error_name(nv, exc)
        return record
    g = _Gpu(nv, handle, record)
    pci = g.get("pci", nv.nvmlDeviceGetPciInfo)
    record.pci_bus_id = _text(pci.busId) if pci is not None else None
    name = g.get("name", nv.nvmlDeviceGetName)
    record.name = _text(name) if name is not None else None
    uuid = g.get("uuid", nv.nvmlDeviceGetUUID)
    record.uuid = _text(uuid) if uuid is not None else None
    serial = g.get("serial", nv.nvmlDeviceGetSerial)
    record.serial = _text(serial) if serial is not None else None
    vbios = g.get("vbios", nv.nvmlDeviceGetVbiosVersion)
    record.vbios = _text(vbios) if vbios is not None else None
    persistence = g.get("persistence_mode", nv.nvmlDeviceGetPersistenceMode)
    record.persistence_mode = None if persistence is None else bool(persistence)
    unc = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    record.ecc_volatile_uncorrected = g.get(
        "ecc_volatile", nv.nvmlDeviceGetTotalEccErrors, unc, nv.NVML_VOLATILE_ECC)
    record.ecc_aggregate_uncorrected = g.get(
        "ecc_aggregate", nv.nvmlDeviceGetTotalEccErrors, unc, nv.NVML_AGGREGATE_ECC)
    record.ecc_aggregate_corrected = g.get(
        "ecc_corrected", nv.nvmlDeviceGetTotalEccErrors, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        nv.NVML_AGGREGATE_ECC)
    sbe = g.get("retired_sbe", nv.nvmlDeviceGetRetiredPages,
                nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    dbe = g.get("retired_dbe", nv.nvmlDeviceGetRetiredPages,
                nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    record.retired_pages = None if sbe is None or dbe is None else len(sbe) + len(dbe)
    pending = g.get("retired_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus)
    record.retired_pending = None if pending is None else bool(pending)
    remap = g.get("remapped_rows", nv.nvmlDeviceGetRemappedRows)
    record.remap = None if remap is None else RemapRows(
        int(remap[0]), int(remap[1]), bool(remap[2]), bool(remap[3]))
    record.throttle_reasons = g.get("throttle", nv.nvmlDeviceGetCurrentClocksThrottleReasons)
    record.temperature_c = g.get("temperature", nv.nvmlDeviceGetTemperature,
                                 nv.NVML_TEMPERATURE_GPU)
    record.pcie = Pcie(
        gen=g.get("pcie_gen", nv.nvmlDeviceGetCurrPcieLinkGeneration),
        gen_max=g.get("pcie_gen_max", nv.nvmlDeviceGetMaxPcieLinkGeneration),
        width=g.get("pcie_width", nv.nvmlDeviceGetCurrPcieLinkWidth),
        width_max=g.get("pcie_width_max", nv.nvmlDeviceGetMaxPcieLinkWidth))
    record.nvlink = _nvlinks(nv, handle, record)
    procs = g.get("processes", nv.nvmlDeviceGetComputeRunningProcesses)
    record.processes = None if procs is None else [
        GpuProcess(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs]
    _memory(nv, g)
    record.fabric = _fabric(nv, g)
    _fields(nv, g)
    record.sram_ecc = _sram(nv, g)
    return record


def _memory(nv: ModuleType, g: _Gpu) -> None:
    """v2 memory info: ``used`` without the driver's reserved memory (v1 counts it as used,
    which on Grace systems reads as leftovers). Drivers before v2 fall back to v1."""
    version = getattr(nv, "nvmlMemory_v2", None)
    rec = g.record
    if version is not None:
        mem = g.get("memory_v2", nv.nvmlDeviceGetMemoryInfo, version=version)
        if mem is not None:
            rec.memory_used_bytes = int(mem.used)
            rec.memory_reserved_bytes = int(mem.reserved)
            rec.memory_info_version = 2
            return
        if "memory_v2" in rec.errors or rec.lost:
            return
    mem = g.get("memory", nv.nvmlDeviceGetMemoryInfo)
    if mem is not None:
        rec.memory_used_bytes = int(mem.used)
        rec.memory_info_version = 1


# Field values read in one nvmlDeviceGetFieldValues call; each has its own return code.
_FIELDS = {
    "recovery_action": "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
    "nvlink_crc_flit": "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "nvlink_crc_data": "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "nvlink_replay": "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "nvlink_recovery": "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
    "pcie_replay": "NVML_FI_DEV_PCIE_REPLAY_COUNTER",
    # The GPU's PCIe error counters: the AER totals where sysfs has none (a VM, a kernel
    # without AER statistics). Only these three: the lane, TLP and NAK counters are not
    # zero on a healthy GPU (the real H200 capture) and are not judged.
    "pcie_correctable": "NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS",
    "pcie_nonfatal": "NVML_FI_DEV_PCIE_COUNT_NON_FATAL_ERROR",
    "pcie_fatal": "NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR",
}
_NVML_AER = {"correctable": "pcie_correctable", "nonfatal": "pcie_nonfatal",
             "fatal": "pcie_fatal"}


def _field_value(nv: ModuleType, v: Any) -> int:
    kind = int(v.valueType)
    if kind == nv.NVML_VALUE_TYPE_DOUBLE:
        return int(v.value.dVal)
    if kind == nv.NVML_VALUE_TYPE_UNSIGNED_INT:
        return int(v.value.uiVal)
    if kind == nv.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return int(v.value.ulVal)
    if kind == nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return int(v.value.sllVal)
    if kind == nv.NVML_VALUE_TYPE_SIGNED_INT:
        return int(v.value.siVal)
    return int(v.value.ullVal)


def _fields(nv: ModuleType, g: _Gpu) -> None:
    rec = g.record
    wanted = {name: getattr(nv, const) for name, const in _FIELDS.items() if hasattr(nv, const)}
    # A pynvml too old to name a field: the same as a driver without it.
    rec.unsupported.extend(n for n in _FIELDS if n not in wanted)
    values = g.get("field_values", nv.nvmlDeviceGetFieldValues, list(wanted.values()))
    got: dict[str, int] = {}
    if values is not None:
        for name, v in zip(wanted, values, strict=True):
            code = int(v.nvmlReturn)
            if code == 0:
                got[name] = _field_value(nv, v)
            elif code in _ABSENT:
                rec.unsupported.append(name)
            elif code == _GPU_IS_LOST:
                rec.lost = True
            else:
                rec.errors[name] = _error_name(nv, nv.NVMLError(code))
    rec.recovery_action = got.get("recovery_action")
    rec.pcie.replay = got.get("pcie_replay")
    links = NvlinkErrors(got.get("nvlink_crc_flit"), got.get("nvlink_crc_data"),
                         got.get("nvlink_replay"), got.get("nvlink_recovery"))
    rec.nvlink_errors = links if links.items() else None
    if all(name in got for name in _NVML_AER.values()):
        rec.pcie_aer = {key: got[name] for key, name in _NVML_AER.items()}
        rec.pcie_aer_source = "nvml"  # until collect() finds sysfs AER, which it prefers


def _sram(nv: ModuleType, g: _Gpu) -> SramEcc | None:
    kind = getattr(nv, "c_nvmlEccSramErrorStatus_v1_t", None)
    if kind is None or not hasattr(nv, "nvmlDeviceGetSramEccErrorStatus"):
        g.record.unsupported.append("sram_ecc")
        return None
    status = kind()
    if g.get("sram_ecc", nv.nvmlDeviceGetSramEccErrorStatus, ctypes.byref(status)) is None:
        return None
    return SramEcc(
        aggregate_uncorrected=int(status.aggregateUncParity) + int(status.aggregateUncSecDed),
        aggregate_corrected=int(status.aggregateCor),
        volatile_corrected=int(status.volatileCor),
        threshold_exceeded=bool(status.bThresholdExceeded))


def _nvlinks(nv: ModuleType, handle: Any, record: GpuRecord) -> list[bool] | None:
    """Active state of each link NVML reports; None on GPUs without NVLink."""
    states: list[bool] = []
    if record.lost:
        return None
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        try:
            states.append(bool(nv.nvmlDeviceGetNvLinkState(handle, link)))
        except nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in (*_ABSENT, _INVALID_ARGUMENT):
                break  # past the last link this GPU has
            if code == _GPU_IS_LOST:
                record.lost = True
                return None
            record.errors["nvlink"] = _error_name(nv, exc)
            break
    return states or None


def _fabric(nv: ModuleType, g: _Gpu) -> Fabric | None:
    """NVSwitch fabric registration (Hopper and later); V3 adds the health mask and
    summary (GB200 NVL72). None where NVML lacks it."""
    v3 = getattr(nv, "c_nvmlGpuFabricInfo_v3_t", None)
    if v3 is not None and hasattr(nv, "nvmlDeviceGetGpuFabricInfoV"):
        info = v3()
        if g.get("fabric_v3", nv.nvmlDeviceGetGpuFabricInfoV, ctypes.byref(info)) is not None:
            return Fabric(int(info.state), int(info.status), int(info.healthMask),
                          int(info.healthSummary), _uuid(info), int(info.cliqueId))
        if "fabric_v3" in g.record.errors or g.record.lost:
            return None
    info_type = getattr(nv, "c_nvmlGpuFabricInfo_t", None)
    if info_type is None or not hasattr(nv, "nvmlDeviceGetGpuFabricInfo"):
        return None
    info = info_type()
    done = g.get("fabric", nv.nvmlDeviceGetGpuFabricInfo, ctypes.byref(info))
    if done is None:
        return None
    return Fabric(int(info.state), int(info.status), cluster_uuid=_uuid(info),
                  clique_id=int(info.cliqueId))


def _uuid(info: Any) -> str:
    """nvmlGpuFabricInfo's clusterUuid (NVML_GPU_FABRIC_UUID_LEN, 16 bytes) as nvidia-smi
    prints it. Read from the structure's memory: some pynvml releases declare the field as a
    char array, whose value stops at the first zero byte."""
    offset = type(info).clusterUuid.offset
    return str(uuid.UUID(bytes=ctypes.string_at(ctypes.addressof(info) + offset, 16)))


def _peermem(modules_file: str) -> bool | None:
    """Whether nvidia_peermem is loaded (``/proc/modules`` lists one module a line)."""
    if not modules_file:
        return None
    try:
        with open(modules_file, encoding="ascii", errors="replace") as fh:
            return any(line.split(" ", 1)[0] == "nvidia_peermem" for line in fh)
    except OSError:
        return None


_AER = {"correctable": ("aer_dev_correctable", "TOTAL_ERR_COR"),
        "nonfatal": ("aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
        "fatal": ("aer_dev_fatal", "TOTAL_ERR_FATAL")}


def read_aer(pci_root: str, bus_id: str) -> dict[str, int] | None:
    """A GPU's PCIe AER totals from ``<pci_root>/<bdf>/aer_dev_*`` (kernel ABI
    sysfs-bus-pci-devices-aer_stats: ``NAME COUNT`` lines ending in ``TOTAL_ERR_*``).
    NVML writes the bus id as ``00000000:18:00.0``; sysfs as ``0000:18:00.0``."""
    dom, rest = bus_id.split(":", 1)
    base = os.path.join(pci_root, f"{int(dom, 16):04x}:{rest.lower()}")
    out: dict[str, int] = {}
    for key, (name, total) in _AER.items():
        try:
            with open(os.path.join(base, name), encoding="ascii", errors="replace") as fh:
                for line in fh:
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == total and parts[1].isdigit():
                        out[key] = int(parts[1])
        except OSError:
            return None  # no AER capability or no such device: not supported here
    return out if len(out) == len(_AER) else None


def collect(backend: str, scenario_dir: str, node: str, modules_file: str = "",
            pci_root: str = "") -> NvmlSnapshot:
    """One snapshot of every GPU the driver lists (and, given ``modules_file``, whether
    nvidia_peermem is loaded). Each GPU's PCIe error totals come from sysfs AER under
    ``pci_root`` when it has them, else from NVML's counters (read with the other fields)."""
    snap = NvmlSnapshot(backend=backend, peermem_loaded=_peermem(modules_file))
    try:
        nv = load_module(backend, scenario_dir, node)
    except ImportError as exc:
        snap.error = f"couldn't import pynvml (install the gpu extra): {exc}"
        return snap
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        snap.error = f"couldn't initialise NVML: {_error_name(nv, exc)}"
        snap.no_driver = getattr(exc, "value", None) in _NO_DRIVER
        return snap
    try:
        snap.driver = _text(nv.nvmlSystemGetDriverVersion())
        count = int(nv.nvmlDeviceGetCount())
        snap.count = count
        snap.gpus = [_read_gpu(nv, i) for i in range(count)]
        for g in snap.gpus:
            sysfs = read_aer(pci_root, g.pci_bus_id) if pci_root and g.pci_bus_id else None
            if sysfs is not None:
                g.pcie_aer, g.pcie_aer_source = sysfs, "sysfs"
            elif g.pcie_aer is None and not g.lost:
                g.unsupported.append("pcie_aer")  # neither sysfs nor NVML has them
    except nv.NVMLError as exc:
        snap.error = f"couldn't list GPUs: {_error_name(nv, exc)}"
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            snap.warnings.append(f"nvmlShutdown: {_error_name(nv, exc)}")
    return snap


def collect_json(backend: str, scenario_dir: str, node: str, modules_file: str = "",
                 pci_root: str = "") -> dict[str, Any]:
    """:func:`collect` for the collector child, whose answer travels as JSON."""
    return collect(backend, scenario_dir, node, modules_file, pci_root).to_json()
