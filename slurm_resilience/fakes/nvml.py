"""A scenario-driven stand-in for ``pynvml`` (nvidia-ml-py).

It implements the calls :mod:`slurm_resilience.health.collectors.nvml` makes,
with pynvml's names, constants and :class:`NVMLError` codes (the numeric values
are NVML's: NOT_SUPPORTED 3, GPU_IS_LOST 15, ...). A scenario is one JSON (or
YAML) file per node, ``<scenario_dir>/<node>.json``::

    {"driver_version": "565.57.01",
     "init_error": null,                       # e.g. "DRIVER_NOT_LOADED"
     "hang": null,                             # {"function": "...", "seconds": 30}
     "gpus": [{"name": ..., "pci_bus_id": "00000000:18:00.0", "lost": false,
               "errors": {"nvmlDeviceGetTemperature": "TIMEOUT"}, ...}, ...]}

``retired_pages: null`` stands for a GPU without page retirement (Ampere and
later answer NOT_SUPPORTED, as the real H100 captures show ``N/A``). A missing
scenario file behaves like a node without the NVIDIA driver. Field values
(nvmlDeviceGetFieldValues) come from a GPU's own keys (``nvlink_errors``,
``pcie_replay``, ``recovery_action``, ``pcie_counters``) or, for any other field,
from ``fields``: ``{"NVML_FI_DEV_MEMORY_TEMP": {"value": 37, "type": 1}}`` or
``{"error": "NOT_SUPPORTED"}``.

The stand-in is checked against reality two ways (:mod:`.nvml_captures`): a scenario
built from real ``nvidia-smi -q`` output, and one from a raw NVML capture
(``nvml-raw.json`` from ``.ci/capture-gpu-outputs``: every call's answer or NVMLError
code).
"""

from __future__ import annotations

import ctypes
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from slurm_resilience.fakes import nvml_constants as C
from slurm_resilience.fakes.nvml_constants import *  # noqa: F403 - pynvml's names, on this module


class c_nvmlGpuFabricInfo_t(ctypes.Structure):
    _fields_ = [
        ("clusterUuid", ctypes.c_uint8 * C.NVML_GPU_FABRIC_UUID_LEN),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
    ]


class c_nvmlGpuFabricInfo_v3_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * C.NVML_GPU_FABRIC_UUID_LEN),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint32),
        ("healthSummary", ctypes.c_uint8),
    ]

    def __init__(self) -> None:
        super().__init__(version=C.nvmlGpuFabricInfo_v3)


class c_nvmlEccSramErrorStatus_v1_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("aggregateUncParity", ctypes.c_ulonglong),
        ("aggregateUncSecDed", ctypes.c_ulonglong),
        ("aggregateCor", ctypes.c_ulonglong),
        ("volatileUncParity", ctypes.c_ulonglong),
        ("volatileUncSecDed", ctypes.c_ulonglong),
        ("volatileCor", ctypes.c_ulonglong),
        ("aggregateUncBucketL2", ctypes.c_ulonglong),
        ("aggregateUncBucketSm", ctypes.c_ulonglong),
        ("aggregateUncBucketPcie", ctypes.c_ulonglong),
        ("aggregateUncBucketMcu", ctypes.c_ulonglong),
        ("aggregateUncBucketOther", ctypes.c_ulonglong),
        ("bThresholdExceeded", ctypes.c_uint),
    ]

    def __init__(self) -> None:
        super().__init__(version=C.nvmlEccSramErrorStatus_v1)


class c_nvmlValue_t(ctypes.Union):
    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class c_nvmlFieldValue_t(ctypes.Structure):
    _fields_ = [
        ("fieldId", ctypes.c_uint32),
        ("scopeId", ctypes.c_uint32),
        ("timestamp", ctypes.c_int64),
        ("latencyUsec", ctypes.c_int64),
        ("valueType", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", c_nvmlValue_t),
    ]


@dataclass(frozen=True)
class _MemoryV2:
    version: int
    total: int
    reserved: int
    free: int
    used: int


@dataclass(frozen=True)
class _PciInfo:
    """nvmlPciInfo_t's fields (pynvml returns bytes for the two bus id strings)."""

    busIdLegacy: bytes
    domain: int
    bus: int
    device: int
    pciDeviceId: int
    pciSubSystemId: int
    busId: bytes


@dataclass(frozen=True)
class _Memory:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class _Process:
    pid: int
    usedGpuMemory: int | None


@dataclass(frozen=True)
class _Handle:
    index: int


# -- scenarios ---------------------------------------------------------------------------------

# The NVML_FI_DEV_PCIE_COUNT_* names, as a scenario's ``pcie_counters`` keys them.
PCIE_COUNTERS = tuple(sorted(n.removeprefix(C.PCIE_COUNT).lower() for n in C.FIELD_NAMES.values()
                             if n.startswith(C.PCIE_COUNT)))

# PCI bus ids of the 8 GPUs in the real healthy 8x H100 capture.
H100_BUS_IDS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
H100_MEMORY = 81559 << 20
# "Reserved" in the real H100 capture (memory the driver keeps; v1 counts it as used).
H100_RESERVED = 454 << 20


def default_gpu(index: int) -> dict[str, Any]:
    """A healthy H100 SXM as the real ``nvidia-smi -q`` capture shows it."""
    bus = H100_BUS_IDS[index] if index < len(H100_BUS_IDS) else f"{0xE0 + index:02X}"
    return {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-5a3e0d6c-0000-4000-8000-{index:012x}",
        # 13 digits, as the capture's "Serial Number" (1650124031592, ...).
        "serial": f"16501240{31592 + index:05d}",
        "pci_bus_id": f"00000000:{bus}:00.0",
        "ecc": {"volatile_uncorrected": 0, "aggregate_uncorrected": 0},
        "retired_pages": None,
        "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False,
                          "failure": False},
        "throttle_reasons": C.nvmlClocksThrottleReasonGpuIdle,
        "temperature_c": 30,
        "pcie": {"gen": 5, "gen_max": 5, "width": 16, "width_max": 16},
        "nvlinks": 18,
        "nvlinks_down": [],
        "memory": {"total": H100_MEMORY, "used": 1 << 20, "reserved": H100_RESERVED},
        "vbios": "96.00.74.00.01",
        "persistence_mode": True,
        # NVLink error totals over all links; PCIe replays; the recovery action (R570+).
        "nvlink_errors": {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0},
        "pcie_replay": 0,
        "recovery_action": C.NVML_GPU_RECOVERY_ACTION_NONE,
        # NVML_FI_DEV_PCIE_COUNT_<NAME> by name in lower case; a missing one (or null for
        # all) answers NOT_SUPPORTED. A healthy idle GPU may show nonzero lane and TLP
        # counts (the real H200 capture did); these are a quiet baseline.
        "pcie_counters": dict.fromkeys(PCIE_COUNTERS, 0),
        # nvmlDeviceGetSramEccErrorStatus; null: NOT_SUPPORTED.
        "sram_ecc": {"aggregate_unc_parity": 0, "aggregate_unc_secded": 0,
                     "aggregate_cor": 0, "volatile_cor": 0, "threshold_exceeded": False},
        "processes": [],
        # H100 HGX on R565: registered; the V3 health mask and summary are NOT_SUPPORTED (0).
        "fabric": {"state": C.NVML_GPU_FABRIC_STATE_COMPLETED, "status": C.NVML_SUCCESS,
                   "health_mask": 0,
                   "health_summary": C.NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED},
        "lost": False,
        "errors": {},
    }


# A GB200 NVL72 GPU's fabric as NCCL's MNNVL line printed it on a real tray (tests/fixtures/
# nvlink-fabric/nccl-info-mnnvl_gb200-4gpu_healthmask-0xaa.txt): registered, every
# health field FALSE (mask 0xaa). nvl72_fabric() puts it in another clique of that cluster.
NVL72_FABRIC: dict[str, Any] = {
    "state": C.NVML_GPU_FABRIC_STATE_COMPLETED, "status": C.NVML_SUCCESS,
    "health_mask": 0xAA, "health_summary": C.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY,
    "clique_id": 0x7FFE, "cluster_uuid": "2b19cdc2-5bb1-4331-935b-fb73549bcc28"}


def nvl72_fabric(clique_id: int | None = None) -> dict[str, Any]:
    return dict(NVL72_FABRIC, **({} if clique_id is None else {"clique_id": clique_id}))


def default_scenario(gpus: int = 8) -> dict[str, Any]:
    return {"driver_version": "565.57.01", "init_error": None, "hang": None,
            "gpus": [default_gpu(i) for i in range(gpus)]}


def scenario_path(scenario_dir: str, node: str) -> str:
    for ext in (".json", ".yaml", ".yml"):
        path = os.path.join(scenario_dir, node + ext)
        if os.path.exists(path):
            return path
    return os.path.join(scenario_dir, node + ".json")


def read_scenario(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"fake nvml: {path}: a scenario must be a mapping")
    return data


def write_scenario(path: str, scenario: dict[str, Any]) -> None:
    """Atomic, so a hook never reads half a scenario."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(scenario, fh, indent=1)
    os.replace(tmp, path)


_scenario: dict[str, Any] | None = None
_scenario_path = ""
_initialised = False


def use_scenario(path: str) -> None:
    """Select the scenario file the next :func:`nvmlInit` reads."""
    global _scenario_path
    _scenario_path = path


# -- the pynvml calls --------------------------------------------------------------------------


def _maybe_hang(function: str) -> None:
    hang = (_scenario or {}).get("hang")
    if hang and hang.get("function") == function:
        time.sleep(float(hang.get("seconds", 3600)))


def _gpu(handle: _Handle, function: str) -> dict[str, Any]:
    if not _initialised or _scenario is None:
        raise C.NVMLError(C.NVML_ERROR_UNINITIALIZED)
    _maybe_hang(function)
    gpus = _scenario["gpus"]
    if handle.index >= len(gpus):
        raise C.NVMLError(C.NVML_ERROR_INVALID_ARGUMENT)
    gpu: dict[str, Any] = gpus[handle.index]
    if gpu.get("lost"):
        raise C.NVMLError(C.NVML_ERROR_GPU_IS_LOST)
    err = gpu.get("errors", {}).get(function)
    if err:
        raise C.NVMLError(C.error_code(err))
    return gpu


def nvmlInit() -> None:
    global _scenario, _initialised
    _scenario = read_scenario(_scenario_path) if _scenario_path else None
    if _scenario is None:
        raise C.NVMLError(C.NVML_ERROR_DRIVER_NOT_LOADED)
    _maybe_hang("nvmlInit")
    if _scenario.get("init_error"):
        raise C.NVMLError(C.error_code(_scenario["init_error"]))
    _initialised = True


def nvmlShutdown() -> None:
    global _initialised
    if not _initialised:
        raise C.NVMLError(C.NVML_ERROR_UNINITIALIZED)
    _initialised = False


def nvmlSystemGetDriverVersion() -> str:
    if not _initialised or _scenario is None:
        raise C.NVMLError(C.NVML_ERROR_UNINITIALIZED)
    return str(_scenario.get("driver_version", "565.57.01"))


def nvmlDeviceGetCount() -> int:
    if not _initialised or _scenario is None:
        raise C.NVMLError(C.NVML_ERROR_UNINITIALIZED)
    _maybe_hang("nvmlDeviceGetCount")
    return len(_scenario["gpus"])


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    handle = _Handle(index)
    _gpu(handle, "nvmlDeviceGetHandleByIndex")
    return handle


def nvmlDeviceGetPciInfo(handle: _Handle) -> _PciInfo:
    gpu = _gpu(handle, "nvmlDeviceGetPciInfo")
    bus_id = str(gpu["pci_bus_id"])
    dom, bus, rest = bus_id.split(":")
    # The legacy id has a 4-digit domain: 00000000:18:00.0 -> 0000:18:00.0.
    legacy = f"{int(dom, 16):04X}:{bus}:{rest}"
    return _PciInfo(busIdLegacy=legacy.encode(), domain=int(dom, 16), bus=int(bus, 16),
                    device=int(rest.split(".")[0], 16),
                    pciDeviceId=int(gpu.get("pci_device_id") or 0),
                    pciSubSystemId=int(gpu.get("pci_subsystem_id") or 0), busId=bus_id.encode())


def nvmlDeviceGetName(handle: _Handle) -> str:
    return str(_gpu(handle, "nvmlDeviceGetName")["name"])


def nvmlDeviceGetUUID(handle: _Handle) -> str:
    return str(_gpu(handle, "nvmlDeviceGetUUID")["uuid"])


def nvmlDeviceGetSerial(handle: _Handle) -> str:
    serial = _gpu(handle, "nvmlDeviceGetSerial").get("serial")
    if serial is None:  # consumer boards: C.NVML_ERROR_NOT_SUPPORTED
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    return str(serial)


def nvmlDeviceGetTotalEccErrors(handle: _Handle, errorType: int, counterType: int
                                ) -> int:
    ecc = _gpu(handle, "nvmlDeviceGetTotalEccErrors").get("ecc")
    if ecc is None:
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    kind = "volatile" if counterType == C.NVML_VOLATILE_ECC else "aggregate"
    what = "uncorrected" if errorType == C.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "corrected"
    return int(ecc.get(f"{kind}_{what}", 0))


def nvmlDeviceGetRetiredPages(handle: _Handle, sourceFilter: int) -> list[int]:
    pages = _gpu(handle, "nvmlDeviceGetRetiredPages").get("retired_pages")
    if pages is None:
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    key = "sbe" if sourceFilter == C.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS \
        else "dbe"
    return [int(a) for a in pages.get(key, [])]


def nvmlDeviceGetRetiredPagesPendingStatus(handle: _Handle) -> int:
    pages = _gpu(handle, "nvmlDeviceGetRetiredPagesPendingStatus").get("retired_pages")
    if pages is None:
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    return C.NVML_FEATURE_ENABLED if pages.get("pending") else C.NVML_FEATURE_DISABLED


def nvmlDeviceGetRemappedRows(handle: _Handle) -> tuple[int, int, int, int]:
    rows = _gpu(handle, "nvmlDeviceGetRemappedRows").get("remapped_rows")
    if rows is None:
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    return (int(rows["correctable"]), int(rows["uncorrectable"]), int(bool(rows["pending"])),
            int(bool(rows["failure"])))


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")["throttle_reasons"])


def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
    gpu = _gpu(handle, "nvmlDeviceGetTemperature")
    if sensor != C.NVML_TEMPERATURE_GPU:
        raise C.NVMLError(C.NVML_ERROR_INVALID_ARGUMENT)
    return int(gpu["temperature_c"])


def _pcie(handle: _Handle, function: str, key: str) -> int:
    pcie = _gpu(handle, function).get("pcie")
    if pcie is None or pcie.get(key) is None:
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    return int(pcie[key])


def nvmlDeviceGetCurrPcieLinkGeneration(handle: _Handle) -> int:
    return _pcie(handle, "nvmlDeviceGetCurrPcieLinkGeneration", "gen")


def nvmlDeviceGetMaxPcieLinkGeneration(handle: _Handle) -> int:
    return _pcie(handle, "nvmlDeviceGetMaxPcieLinkGeneration", "gen_max")


def nvmlDeviceGetCurrPcieLinkWidth(handle: _Handle) -> int:
    return _pcie(handle, "nvmlDeviceGetCurrPcieLinkWidth", "width")


def nvmlDeviceGetMaxPcieLinkWidth(handle: _Handle) -> int:
    return _pcie(handle, "nvmlDeviceGetMaxPcieLinkWidth", "width_max")


def nvmlDeviceGetNvLinkState(handle: _Handle, link: int) -> int:
    gpu = _gpu(handle, "nvmlDeviceGetNvLinkState")
    links = int(gpu.get("nvlinks", 0))
    if links == 0:
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    if link >= links:
        raise C.NVMLError(C.NVML_ERROR_INVALID_ARGUMENT)
    down = gpu.get("nvlinks_down", [])
    return C.NVML_FEATURE_DISABLED if link in down else C.NVML_FEATURE_ENABLED


def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[_Process]:
    procs = _gpu(handle, "nvmlDeviceGetComputeRunningProcesses").get("processes", [])
    return [_Process(int(p["pid"]), p.get("used_bytes")) for p in procs]


def nvmlDeviceGetMemoryInfo(handle: _Handle, version: int | None = None) -> _Memory | _MemoryV2:
    """v1 counts the driver's reserved memory as used; v2 (``version=C.nvmlMemory_v2``,
    nvmlDeviceGetMemoryInfo_v2) reports it apart. ``memory.v2: false`` in a scenario
    stands for a driver without v2 (FUNCTION_NOT_FOUND)."""
    gpu = _gpu(handle, "nvmlDeviceGetMemoryInfo")
    mem = gpu["memory"]
    total, used, reserved = int(mem["total"]), int(mem["used"]), int(mem.get("reserved", 0))
    if not version:
        return _Memory(total, total - used - reserved, used + reserved)
    if mem.get("v2") is False:
        raise C.NVMLError(C.NVML_ERROR_FUNCTION_NOT_FOUND)
    if version != C.nvmlMemory_v2:
        raise C.NVMLError(C.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    return _MemoryV2(version, total, reserved, total - used - reserved, used)


def nvmlDeviceGetVbiosVersion(handle: _Handle) -> str:
    vbios = _gpu(handle, "nvmlDeviceGetVbiosVersion").get("vbios")
    if vbios is None:
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    return str(vbios)


def nvmlDeviceGetPersistenceMode(handle: _Handle) -> int:
    mode = _gpu(handle, "nvmlDeviceGetPersistenceMode").get("persistence_mode")
    if mode is None:
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    return C.NVML_FEATURE_ENABLED if mode else C.NVML_FEATURE_DISABLED


def _field(gpu: dict[str, Any], field_id: int) -> tuple[int, int, int]:
    """(return code, value type, value) of one field on this GPU. The value types are
    those the real H200 (driver 580) answered: unsigned int for the PCIe counters, the
    replay counter, the link count and the recovery action."""
    ui, ull = C.NVML_VALUE_TYPE_UNSIGNED_INT, C.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    name = C.FIELD_NAMES.get(field_id, "")
    recorded = (gpu.get("fields") or {}).get(name)
    if recorded is not None:  # {"value": 16, "type": 1} or {"error": "NOT_SUPPORTED"}
        kind = int(recorded.get("type", ull))
        if recorded.get("error"):
            return C.error_code(str(recorded["error"])), kind, 0
        return C.NVML_SUCCESS, kind, int(recorded["value"])
    links = gpu.get("nvlink_errors")
    if field_id in C.NVLINK_TOTALS:
        key = C.NVLINK_TOTALS[field_id]
        if not links or not gpu.get("nvlinks") or links.get(key) is None:
            return C.NVML_ERROR_NOT_SUPPORTED, ull, 0
        return C.NVML_SUCCESS, ull, int(links[key])
    if field_id == C.NVML_FI_DEV_NVLINK_LINK_COUNT:
        count = int(gpu.get("nvlinks", 0))
        return (C.NVML_SUCCESS, ui, count) if count else (C.NVML_ERROR_NOT_SUPPORTED, ui, 0)
    if field_id == C.NVML_FI_DEV_PCIE_REPLAY_COUNTER:
        replays = gpu.get("pcie_replay")
        if replays is None:
            return C.NVML_ERROR_NOT_SUPPORTED, ui, 0
        return C.NVML_SUCCESS, ui, int(replays)
    if field_id == C.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
        action = gpu.get("recovery_action")
        # Drivers that don't know the field answer NOT_SUPPORTED in its nvmlReturn (the
        # real captures show it from R565's nvidia-smi on; earlier ones have no line).
        if action is None:
            return C.NVML_ERROR_NOT_SUPPORTED, ui, 0
        return C.NVML_SUCCESS, ui, int(action)
    if name.startswith(C.PCIE_COUNT):
        counted = (gpu.get("pcie_counters") or {}).get(name.removeprefix(C.PCIE_COUNT).lower())
        if counted is None:
            return C.NVML_ERROR_NOT_SUPPORTED, ui, 0
        return C.NVML_SUCCESS, ui, int(counted)
    return C.NVML_ERROR_NOT_SUPPORTED, ull, 0


def nvmlDeviceGetFieldValues(handle: _Handle, fieldIds: list[int]) -> Any:
    """As pynvml: an array of c_nvmlFieldValue_t, each with its own ``nvmlReturn``."""
    gpu = _gpu(handle, "nvmlDeviceGetFieldValues")
    values = (c_nvmlFieldValue_t * len(fieldIds))()
    for i, field_id in enumerate(fieldIds):
        code, kind, value = _field(gpu, int(field_id))
        values[i].fieldId = field_id
        values[i].nvmlReturn = code
        values[i].valueType = kind
        if kind == C.NVML_VALUE_TYPE_DOUBLE:
            values[i].value.dVal = float(value)
        elif kind == C.NVML_VALUE_TYPE_UNSIGNED_INT:
            values[i].value.uiVal = value
        else:
            values[i].value.ullVal = value
    return values


# nvmlDeviceGetSramEccErrorStatus: scenario key -> c_nvmlEccSramErrorStatus_v1_t field.
SRAM_KEYS = {"aggregate_unc_parity": "aggregateUncParity",
              "aggregate_unc_secded": "aggregateUncSecDed", "aggregate_cor": "aggregateCor",
              "volatile_unc_parity": "volatileUncParity",
              "volatile_unc_secded": "volatileUncSecDed", "volatile_cor": "volatileCor",
              "aggregate_unc_bucket_l2": "aggregateUncBucketL2",
              "aggregate_unc_bucket_sm": "aggregateUncBucketSm",
              "aggregate_unc_bucket_pcie": "aggregateUncBucketPcie",
              "aggregate_unc_bucket_mcu": "aggregateUncBucketMcu",
              "aggregate_unc_bucket_other": "aggregateUncBucketOther"}


def nvmlDeviceGetSramEccErrorStatus(handle: _Handle, status: Any) -> int:
    sram = _gpu(handle, "nvmlDeviceGetSramEccErrorStatus").get("sram_ecc")
    if sram is None:
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    obj = status._obj if hasattr(status, "_obj") else status
    for key, attr in SRAM_KEYS.items():
        setattr(obj, attr, int(sram.get(key, 0)))
    obj.bThresholdExceeded = int(bool(sram.get("threshold_exceeded")))
    return C.NVML_SUCCESS


def nvmlDeviceGetGpuFabricInfoV(handle: _Handle, gpuFabricInfo: Any) -> int:
    fab = _gpu(handle, "nvmlDeviceGetGpuFabricInfoV").get("fabric")
    if fab is None:
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    info = gpuFabricInfo._obj if hasattr(gpuFabricInfo, "_obj") else gpuFabricInfo
    if info.version != C.nvmlGpuFabricInfo_v3:
        raise C.NVMLError(C.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    info.state = int(fab["state"])
    info.status = int(fab.get("status", 0))
    info.healthMask = int(fab.get("health_mask", 0))
    info.healthSummary = int(fab.get("health_summary", 0))
    _identity(info, fab)
    return C.NVML_SUCCESS


def _identity(info: Any, fab: dict[str, Any]) -> None:
    """The NVLink domain's cluster UUID (a UUID string in the scenario) and clique id;
    zeros where the scenario has none, as NVML answers on a GPU outside any domain."""
    raw = uuid.UUID(fab["cluster_uuid"]).bytes if fab.get("cluster_uuid") else bytes(16)
    for i, byte in enumerate(raw):
        info.clusterUuid[i] = byte
    info.cliqueId = int(fab.get("clique_id") or 0)


def nvmlDeviceGetGpuFabricInfo(handle: _Handle, gpuFabricInfo: Any) -> int:
    fab = _gpu(handle, "nvmlDeviceGetGpuFabricInfo").get("fabric")
    if fab is None:
        raise C.NVMLError(C.NVML_ERROR_NOT_SUPPORTED)
    info = gpuFabricInfo._obj if hasattr(gpuFabricInfo, "_obj") else gpuFabricInfo
    info.state = int(fab["state"])
    info.status = int(fab.get("status", 0))
    _identity(info, fab)
    return C.NVML_SUCCESS
