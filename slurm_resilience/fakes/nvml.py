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

The stand-in is checked against reality two ways: :func:`scenario_from_nvidia_smi`
builds a scenario from real ``nvidia-smi -q`` output, and
:func:`scenario_from_nvml_raw` from a raw NVML capture (``nvml-raw.json`` from
``.ci/capture-gpu-outputs``: every call's answer or NVMLError code).
"""

from __future__ import annotations

import copy
import ctypes
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

# -- constants, with NVML's values -------------------------------------------------------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
NVML_NVLINK_MAX_LINKS = 36
NVML_GPU_FABRIC_UUID_LEN = 16
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0
NVML_GPU_FABRIC_STATE_NOT_STARTED = 1
NVML_GPU_FABRIC_STATE_IN_PROGRESS = 2
NVML_GPU_FABRIC_STATE_COMPLETED = 3
NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_NOT_SUPPORTED = 0
NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE = 1
NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE = 2
NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW = 0
NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW = 0x3
NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_RECOVERY_TRUE = 1
NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY = 2
NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_ROUTE_RECOVERY = 0x3
NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_TRUE = 1
NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY = 4
NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_ROUTE_UNHEALTHY = 0x3
NVML_GPU_FABRIC_HEALTH_MASK_ACCESS_TIMEOUT_RECOVERY_TRUE = 1
NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY = 6
NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_ACCESS_TIMEOUT_RECOVERY = 0x3
NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE = 1
NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION = 8
NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_INCORRECT_CONFIGURATION = 0xF
NVML_GPU_FABRIC_HEALTH_MASK_GFM_STATE_DISCONNECTED = 2
NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_GFM_STATE = 14
NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_GFM_STATE = 0x3
NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED = 0
NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY = 1
NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY = 2
NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY = 3
nvmlGpuFabricInfo_v3 = 0x3000028

nvmlMemory_v2 = 0x02000028
nvmlEccSramErrorStatus_v1 = 0x1000068

# Field ids (nvmlDeviceGetFieldValues), as in nvml.h.
NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL = 38
NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL = 45
NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL = 52
NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL = 59
NVML_FI_DEV_PCIE_REPLAY_COUNTER = 94
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NVML_FI_DEV_RETIRED_SBE = 29
NVML_FI_DEV_RETIRED_DBE = 30
NVML_FI_DEV_RETIRED_PENDING = 31
NVML_FI_DEV_RETIRED_PENDING_SBE = 92
NVML_FI_DEV_RETIRED_PENDING_DBE = 93
NVML_FI_DEV_MEMORY_TEMP = 82
NVML_FI_DEV_NVLINK_LINK_COUNT = 91
NVML_FI_DEV_REMAPPED_COR = 142
NVML_FI_DEV_REMAPPED_UNC = 143
NVML_FI_DEV_REMAPPED_PENDING = 144
NVML_FI_DEV_REMAPPED_FAILURE = 145
NVML_FI_DEV_REMAPPED_ROWS_COR_INACTIVE = 301
NVML_FI_DEV_REMAPPED_ROWS_UNC_INACTIVE = 302
# PCIe counters of the GPU's own link (R470+); ``pcie_counters`` in a scenario, keyed by
# the name after NVML_FI_DEV_PCIE_COUNT_, lower case.
NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS = 173
NVML_FI_DEV_PCIE_COUNT_NAKS_RECEIVED = 174
NVML_FI_DEV_PCIE_COUNT_RECEIVER_ERROR = 175
NVML_FI_DEV_PCIE_COUNT_BAD_TLP = 176
NVML_FI_DEV_PCIE_COUNT_NAKS_SENT = 177
NVML_FI_DEV_PCIE_COUNT_BAD_DLLP = 178
NVML_FI_DEV_PCIE_COUNT_NON_FATAL_ERROR = 179
NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR = 180
NVML_FI_DEV_PCIE_COUNT_UNSUPPORTED_REQ = 181
NVML_FI_DEV_PCIE_COUNT_LCRC_ERROR = 182
NVML_FI_DEV_PCIE_COUNT_LANE_ERROR = 183
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4
NVML_VALUE_TYPE_SIGNED_INT = 5

# nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION).
NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
NVML_GPU_RECOVERY_ACTION_DRAIN_P2P = 3
NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET = 4

nvmlClocksThrottleReasonGpuIdle = 0x0000000000000001
nvmlClocksThrottleReasonApplicationsClocksSetting = 0x0000000000000002
nvmlClocksThrottleReasonSwPowerCap = 0x0000000000000004
nvmlClocksThrottleReasonHwSlowdown = 0x0000000000000008
nvmlClocksThrottleReasonSyncBoost = 0x0000000000000010
nvmlClocksThrottleReasonSwThermalSlowdown = 0x0000000000000020
nvmlClocksThrottleReasonHwThermalSlowdown = 0x0000000000000040
nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x0000000000000080
nvmlClocksThrottleReasonDisplayClockSetting = 0x0000000000000100
nvmlClocksThrottleReasonNone = 0x0000000000000000

_NVLINK_TOTALS = {NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: "crc_flit",
                  NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: "crc_data",
                  NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: "replay",
                  NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: "recovery"}
_PCIE_COUNT = "NVML_FI_DEV_PCIE_COUNT_"


def _field_names() -> dict[int, str]:
    return {v: k for k, v in globals().items()
            if k.startswith("NVML_FI_DEV_") and isinstance(v, int)}


FIELD_NAMES = _field_names()
# Fields answered from a scenario's own keys; any other is answered as the scenario's
# ``fields`` records it (by pynvml name), else NOT_SUPPORTED.
MODELLED_FIELDS = frozenset({
    *_NVLINK_TOTALS, NVML_FI_DEV_NVLINK_LINK_COUNT, NVML_FI_DEV_PCIE_REPLAY_COUNTER,
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION,
    *(i for i, n in FIELD_NAMES.items() if n.startswith(_PCIE_COUNT))})


_ERROR_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """pynvml's exception: ``.value`` is the NVML return code."""

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _ERROR_STRINGS.get(self.value, f"Unknown Error {self.value}")


def error_code(name: str) -> int:
    """``"GPU_IS_LOST"`` → 15; scenarios name errors, the stand-in raises codes."""
    value = globals().get(f"NVML_ERROR_{name.upper()}")
    if not isinstance(value, int):
        raise ValueError(f"fake nvml: unknown NVML error name {name!r}")
    return value


class c_nvmlGpuFabricInfo_t(ctypes.Structure):
    _fields_ = [
        ("clusterUuid", ctypes.c_uint8 * NVML_GPU_FABRIC_UUID_LEN),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
    ]


class c_nvmlGpuFabricInfo_v3_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * NVML_GPU_FABRIC_UUID_LEN),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint32),
        ("healthSummary", ctypes.c_uint8),
    ]

    def __init__(self) -> None:
        super().__init__(version=nvmlGpuFabricInfo_v3)


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
        super().__init__(version=nvmlEccSramErrorStatus_v1)


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
PCIE_COUNTERS = tuple(sorted(n.removeprefix(_PCIE_COUNT).lower() for n in FIELD_NAMES.values()
                             if n.startswith(_PCIE_COUNT)))

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
        "throttle_reasons": nvmlClocksThrottleReasonGpuIdle,
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
        "recovery_action": NVML_GPU_RECOVERY_ACTION_NONE,
        # NVML_FI_DEV_PCIE_COUNT_<NAME> by name in lower case; a missing one (or null for
        # all) answers NOT_SUPPORTED. A healthy idle GPU may show nonzero lane and TLP
        # counts (the real H200 capture did); these are a quiet baseline.
        "pcie_counters": dict.fromkeys(PCIE_COUNTERS, 0),
        # nvmlDeviceGetSramEccErrorStatus; null: NOT_SUPPORTED.
        "sram_ecc": {"aggregate_unc_parity": 0, "aggregate_unc_secded": 0,
                     "aggregate_cor": 0, "volatile_cor": 0, "threshold_exceeded": False},
        "processes": [],
        # H100 HGX on R565: registered; the V3 health mask and summary are NOT_SUPPORTED (0).
        "fabric": {"state": NVML_GPU_FABRIC_STATE_COMPLETED, "status": NVML_SUCCESS,
                   "health_mask": 0,
                   "health_summary": NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED},
        "lost": False,
        "errors": {},
    }


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
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    _maybe_hang(function)
    gpus = _scenario["gpus"]
    if handle.index >= len(gpus):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    gpu: dict[str, Any] = gpus[handle.index]
    if gpu.get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    err = gpu.get("errors", {}).get(function)
    if err:
        raise NVMLError(error_code(err))
    return gpu


def nvmlInit() -> None:
    global _scenario, _initialised
    _scenario = read_scenario(_scenario_path) if _scenario_path else None
    if _scenario is None:
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
    _maybe_hang("nvmlInit")
    if _scenario.get("init_error"):
        raise NVMLError(error_code(_scenario["init_error"]))
    _initialised = True


def nvmlShutdown() -> None:
    global _initialised
    if not _initialised:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    _initialised = False


def nvmlSystemGetDriverVersion() -> str:
    if not _initialised or _scenario is None:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    return str(_scenario.get("driver_version", "565.57.01"))


def nvmlDeviceGetCount() -> int:
    if not _initialised or _scenario is None:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
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
    if serial is None:  # consumer boards: NVML_ERROR_NOT_SUPPORTED
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return str(serial)


def nvmlDeviceGetTotalEccErrors(handle: _Handle, errorType: int, counterType: int
                                ) -> int:
    ecc = _gpu(handle, "nvmlDeviceGetTotalEccErrors").get("ecc")
    if ecc is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    kind = "volatile" if counterType == NVML_VOLATILE_ECC else "aggregate"
    what = "uncorrected" if errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "corrected"
    return int(ecc.get(f"{kind}_{what}", 0))


def nvmlDeviceGetRetiredPages(handle: _Handle, sourceFilter: int) -> list[int]:
    pages = _gpu(handle, "nvmlDeviceGetRetiredPages").get("retired_pages")
    if pages is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    key = "sbe" if sourceFilter == NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS \
        else "dbe"
    return [int(a) for a in pages.get(key, [])]


def nvmlDeviceGetRetiredPagesPendingStatus(handle: _Handle) -> int:
    pages = _gpu(handle, "nvmlDeviceGetRetiredPagesPendingStatus").get("retired_pages")
    if pages is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return NVML_FEATURE_ENABLED if pages.get("pending") else NVML_FEATURE_DISABLED


def nvmlDeviceGetRemappedRows(handle: _Handle) -> tuple[int, int, int, int]:
    rows = _gpu(handle, "nvmlDeviceGetRemappedRows").get("remapped_rows")
    if rows is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return (int(rows["correctable"]), int(rows["uncorrectable"]), int(bool(rows["pending"])),
            int(bool(rows["failure"])))


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: _Handle) -> int:
    return int(_gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")["throttle_reasons"])


def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
    gpu = _gpu(handle, "nvmlDeviceGetTemperature")
    if sensor != NVML_TEMPERATURE_GPU:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return int(gpu["temperature_c"])


def _pcie(handle: _Handle, function: str, key: str) -> int:
    pcie = _gpu(handle, function).get("pcie")
    if pcie is None or pcie.get(key) is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
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
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if link >= links:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    down = gpu.get("nvlinks_down", [])
    return NVML_FEATURE_DISABLED if link in down else NVML_FEATURE_ENABLED


def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[_Process]:
    procs = _gpu(handle, "nvmlDeviceGetComputeRunningProcesses").get("processes", [])
    return [_Process(int(p["pid"]), p.get("used_bytes")) for p in procs]


def nvmlDeviceGetMemoryInfo(handle: _Handle, version: int | None = None) -> _Memory | _MemoryV2:
    """v1 counts the driver's reserved memory as used; v2 (``version=nvmlMemory_v2``,
    nvmlDeviceGetMemoryInfo_v2) reports it apart. ``memory.v2: false`` in a scenario
    stands for a driver without v2 (FUNCTION_NOT_FOUND)."""
    gpu = _gpu(handle, "nvmlDeviceGetMemoryInfo")
    mem = gpu["memory"]
    total, used, reserved = int(mem["total"]), int(mem["used"]), int(mem.get("reserved", 0))
    if not version:
        return _Memory(total, total - used - reserved, used + reserved)
    if mem.get("v2") is False:
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
    if version != nvmlMemory_v2:
        raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    return _MemoryV2(version, total, reserved, total - used - reserved, used)


def nvmlDeviceGetVbiosVersion(handle: _Handle) -> str:
    vbios = _gpu(handle, "nvmlDeviceGetVbiosVersion").get("vbios")
    if vbios is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return str(vbios)


def nvmlDeviceGetPersistenceMode(handle: _Handle) -> int:
    mode = _gpu(handle, "nvmlDeviceGetPersistenceMode").get("persistence_mode")
    if mode is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return NVML_FEATURE_ENABLED if mode else NVML_FEATURE_DISABLED


def _field(gpu: dict[str, Any], field_id: int) -> tuple[int, int, int]:
    """(return code, value type, value) of one field on this GPU. The value types are
    those the real H200 (driver 580) answered: unsigned int for the PCIe counters, the
    replay counter, the link count and the recovery action."""
    ui, ull = NVML_VALUE_TYPE_UNSIGNED_INT, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    name = FIELD_NAMES.get(field_id, "")
    recorded = (gpu.get("fields") or {}).get(name)
    if recorded is not None:  # {"value": 16, "type": 1} or {"error": "NOT_SUPPORTED"}
        kind = int(recorded.get("type", ull))
        if recorded.get("error"):
            return error_code(str(recorded["error"])), kind, 0
        return NVML_SUCCESS, kind, int(recorded["value"])
    links = gpu.get("nvlink_errors")
    if field_id in _NVLINK_TOTALS:
        key = _NVLINK_TOTALS[field_id]
        if not links or not gpu.get("nvlinks") or links.get(key) is None:
            return NVML_ERROR_NOT_SUPPORTED, ull, 0
        return NVML_SUCCESS, ull, int(links[key])
    if field_id == NVML_FI_DEV_NVLINK_LINK_COUNT:
        count = int(gpu.get("nvlinks", 0))
        return (NVML_SUCCESS, ui, count) if count else (NVML_ERROR_NOT_SUPPORTED, ui, 0)
    if field_id == NVML_FI_DEV_PCIE_REPLAY_COUNTER:
        replays = gpu.get("pcie_replay")
        if replays is None:
            return NVML_ERROR_NOT_SUPPORTED, ui, 0
        return NVML_SUCCESS, ui, int(replays)
    if field_id == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
        action = gpu.get("recovery_action")
        # Drivers that don't know the field answer NOT_SUPPORTED in its nvmlReturn (the
        # real captures show it from R565's nvidia-smi on; earlier ones have no line).
        if action is None:
            return NVML_ERROR_NOT_SUPPORTED, ui, 0
        return NVML_SUCCESS, ui, int(action)
    if name.startswith(_PCIE_COUNT):
        counted = (gpu.get("pcie_counters") or {}).get(name.removeprefix(_PCIE_COUNT).lower())
        if counted is None:
            return NVML_ERROR_NOT_SUPPORTED, ui, 0
        return NVML_SUCCESS, ui, int(counted)
    return NVML_ERROR_NOT_SUPPORTED, ull, 0


def nvmlDeviceGetFieldValues(handle: _Handle, fieldIds: list[int]) -> Any:
    """As pynvml: an array of c_nvmlFieldValue_t, each with its own ``nvmlReturn``."""
    gpu = _gpu(handle, "nvmlDeviceGetFieldValues")
    values = (c_nvmlFieldValue_t * len(fieldIds))()
    for i, field_id in enumerate(fieldIds):
        code, kind, value = _field(gpu, int(field_id))
        values[i].fieldId = field_id
        values[i].nvmlReturn = code
        values[i].valueType = kind
        if kind == NVML_VALUE_TYPE_DOUBLE:
            values[i].value.dVal = float(value)
        elif kind == NVML_VALUE_TYPE_UNSIGNED_INT:
            values[i].value.uiVal = value
        else:
            values[i].value.ullVal = value
    return values


# nvmlDeviceGetSramEccErrorStatus: scenario key -> c_nvmlEccSramErrorStatus_v1_t field.
_SRAM_KEYS = {"aggregate_unc_parity": "aggregateUncParity",
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
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    obj = status._obj if hasattr(status, "_obj") else status
    for key, attr in _SRAM_KEYS.items():
        setattr(obj, attr, int(sram.get(key, 0)))
    obj.bThresholdExceeded = int(bool(sram.get("threshold_exceeded")))
    return NVML_SUCCESS


def nvmlDeviceGetGpuFabricInfoV(handle: _Handle, gpuFabricInfo: Any) -> int:
    fab = _gpu(handle, "nvmlDeviceGetGpuFabricInfoV").get("fabric")
    if fab is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    info = gpuFabricInfo._obj if hasattr(gpuFabricInfo, "_obj") else gpuFabricInfo
    if info.version != nvmlGpuFabricInfo_v3:
        raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    info.state = int(fab["state"])
    info.status = int(fab.get("status", 0))
    info.healthMask = int(fab.get("health_mask", 0))
    info.healthSummary = int(fab.get("health_summary", 0))
    return NVML_SUCCESS


def nvmlDeviceGetGpuFabricInfo(handle: _Handle, gpuFabricInfo: Any) -> int:
    fab = _gpu(handle, "nvmlDeviceGetGpuFabricInfo").get("fabric")
    if fab is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    info = gpuFabricInfo._obj if hasattr(gpuFabricInfo, "_obj") else gpuFabricInfo
    info.state = int(fab["state"])
    info.status = int(fab.get("status", 0))
    return NVML_SUCCESS


# -- building scenarios from real nvidia-smi -q output ----------------------------------------

_LINE = re.compile(r"^(?P<indent> *)(?P<key>[^:]+?)\s*(?::\s*(?P<value>.*?))?\s*$")


def _tree(lines: list[str]) -> dict[str, Any]:
    """nvidia-smi -q's indented ``Key : Value`` blocks as nested dicts."""
    root: dict[str, Any] = {}
    stack: list[tuple[int, dict[str, Any]]] = [(-1, root)]
    for line in lines:
        if not line.strip():
            continue
        m = _LINE.match(line)
        if not m:
            continue
        indent = len(m["indent"])
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        if m["value"] is None:
            child: dict[str, Any] = {}
            parent[m["key"]] = child
            stack.append((indent, child))
        else:
            parent[m["key"]] = m["value"]
    return root


def _num(text: Any) -> int | None:
    m = re.match(r"^\s*(\d+)", str(text)) if text is not None else None
    return int(m.group(1)) if m else None


_REASON_BITS = {
    "Idle": nvmlClocksThrottleReasonGpuIdle,
    "Applications Clocks Setting": nvmlClocksThrottleReasonApplicationsClocksSetting,
    "SW Power Cap": nvmlClocksThrottleReasonSwPowerCap,
    "HW Slowdown": nvmlClocksThrottleReasonHwSlowdown,
    "HW Thermal Slowdown": nvmlClocksThrottleReasonHwThermalSlowdown,
    "HW Power Brake Slowdown": nvmlClocksThrottleReasonHwPowerBrakeSlowdown,
    "Sync Boost": nvmlClocksThrottleReasonSyncBoost,
    "SW Thermal Slowdown": nvmlClocksThrottleReasonSwThermalSlowdown,
    "Display Clock Setting": nvmlClocksThrottleReasonDisplayClockSetting,
}


def _reasons(block: dict[str, Any]) -> int:
    bits = 0
    for key, value in block.items():
        if isinstance(value, dict):
            bits |= _reasons(value)
        elif value == "Active":
            bits |= _REASON_BITS.get(key, 0)
    return bits


def _ecc_uncorrected(block: Any) -> int | None:
    if not isinstance(block, dict):
        return None
    if "DRAM Uncorrectable" in block:  # Ampere and later
        total = 0
        for key in ("DRAM Uncorrectable", "SRAM Uncorrectable Parity",
                    "SRAM Uncorrectable SEC-DED", "SRAM Uncorrectable"):
            total += _num(block.get(key)) or 0
        return total
    double = block.get("Double Bit")  # Volta: Single/Double Bit x location, with a Total
    return _num(double.get("Total")) if isinstance(double, dict) else None


_RECOVERY = {"None": NVML_GPU_RECOVERY_ACTION_NONE, "GPU Reset": NVML_GPU_RECOVERY_ACTION_GPU_RESET,
             "Node Reboot": NVML_GPU_RECOVERY_ACTION_NODE_REBOOT,
             "Drain P2P": NVML_GPU_RECOVERY_ACTION_DRAIN_P2P,
             "Drain and Reset": NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET}


def _sram_from_smi(ecc: Any) -> dict[str, Any] | None:
    agg, vol = ecc.get("Aggregate"), ecc.get("Volatile")
    if not isinstance(agg, dict) or "SRAM Threshold Exceeded" not in agg:
        return None  # older drivers: no SRAM status (NOT_SUPPORTED)
    return {"aggregate_unc_parity": _num(agg.get("SRAM Uncorrectable Parity")) or 0,
            "aggregate_unc_secded": _num(agg.get("SRAM Uncorrectable SEC-DED")) or 0,
            "aggregate_cor": _num(agg.get("SRAM Correctable")) or 0,
            "volatile_cor": _num((vol or {}).get("SRAM Correctable")) or 0,
            "threshold_exceeded": agg.get("SRAM Threshold Exceeded") == "Yes"}


def _ecc_corrected(block: Any) -> int | None:
    if not isinstance(block, dict):
        return None
    if "DRAM Correctable" in block:  # Ampere and later
        return (_num(block.get("DRAM Correctable")) or 0) + \
            (_num(block.get("SRAM Correctable")) or 0)
    single = block.get("Single Bit")  # Volta
    return _num(single.get("Total")) if isinstance(single, dict) else None


def _gpu_from_smi(bus_id: str, block: dict[str, Any]) -> dict[str, Any]:
    pci = block.get("PCI", {})
    link = pci.get("GPU Link Info", {})
    gen, width = link.get("PCIe Generation", {}), link.get("Link Width", {})
    ecc = block.get("ECC Errors", {})
    retired = block.get("Retired Pages")
    remap = block.get("Remapped Rows")
    fb = block.get("FB Memory Usage", {})
    fabric = block.get("Fabric")
    reasons = block.get("Clocks Event Reasons") or block.get("Clocks Throttle Reasons") or {}
    gpu: dict[str, Any] = {
        "name": block.get("Product Name"),
        "uuid": block.get("GPU UUID"),
        "serial": None if block.get("Serial Number") in (None, "N/A")
        else block.get("Serial Number"),
        "pci_bus_id": bus_id,
        "ecc": {"volatile_uncorrected": _ecc_uncorrected(ecc.get("Volatile")) or 0,
                "aggregate_uncorrected": _ecc_uncorrected(ecc.get("Aggregate")) or 0,
                "aggregate_corrected": _ecc_corrected(ecc.get("Aggregate")) or 0},
        "retired_pages": None,
        "remapped_rows": None,
        "throttle_reasons": _reasons(reasons),
        "temperature_c": _num(block.get("Temperature", {}).get("GPU Current Temp")),
        "pcie": {"gen": _num(gen.get("Current")), "gen_max": _num(gen.get("Max")),
                 "width": _num(width.get("Current")), "width_max": _num(width.get("Max"))},
        "nvlinks": 0,
        "nvlinks_down": [],
        "memory": {"total": (_num(fb.get("Total")) or 0) << 20,
                   "used": (_num(fb.get("Used")) or 0) << 20,
                   "reserved": (_num(fb.get("Reserved")) or 0) << 20},
        "vbios": block.get("VBIOS Version"),
        "persistence_mode": {"Enabled": True, "Disabled": False}.get(
            str(block.get("Persistence Mode"))),
        "nvlink_errors": None,  # not in nvidia-smi -q (nvidia-smi nvlink -e has them)
        "pcie_replay": _num(pci.get("Replays Since Reset")),
        "recovery_action": _RECOVERY.get(str(block.get("GPU Recovery Action"))),
        "sram_ecc": _sram_from_smi(ecc),
        "processes": [],
        "fabric": None,
        "lost": False,
        "errors": {},
    }
    if isinstance(retired, dict) and _num(retired.get("Single Bit ECC")) is not None:
        sbe = _num(retired.get("Single Bit ECC")) or 0
        dbe = _num(retired.get("Double Bit ECC")) or 0
        gpu["retired_pages"] = {"sbe": list(range(sbe)), "dbe": list(range(dbe)),
                                "pending": retired.get("Pending Page Blacklist") == "Yes"}
    if isinstance(remap, dict):
        gpu["remapped_rows"] = {
            "correctable": _num(remap.get("Correctable Error")) or 0,
            "uncorrectable": _num(remap.get("Uncorrectable Error")) or 0,
            "pending": remap.get("Pending") == "Yes",
            "failure": remap.get("Remapping Failure Occurred") == "Yes"}
    if isinstance(fabric, dict):
        states = {"N/A": 0, "Not Supported": 0, "Not Started": 1, "In Progress": 2,
                  "Completed": 3}
        gpu["fabric"] = {"state": states.get(str(fabric.get("State")), 0),
                         "status": 0 if fabric.get("Status") in ("Success", "N/A") else 999,
                         "health_mask": 0, "health_summary": 0}
    return gpu


def scenario_from_nvidia_smi(text: str) -> dict[str, Any]:
    """A scenario reproducing what a real ``nvidia-smi -q`` capture shows."""
    blocks: list[tuple[str, list[str]]] = []
    driver = ""
    for line in text.splitlines():
        if line.startswith("GPU ") and re.match(r"^GPU [0-9A-Fa-f]{8}:", line):
            blocks.append((line.split()[1], []))
        elif blocks:
            blocks[-1][1].append(line)
        elif line.startswith("Driver Version"):
            driver = line.split(":", 1)[1].strip()
    gpus = [_gpu_from_smi(bus, _tree(lines)) for bus, lines in blocks]
    return {"driver_version": driver, "init_error": None, "hang": None,
            "gpus": copy.deepcopy(gpus)}


# -- building scenarios from a raw NVML capture (.ci/capture-gpu-outputs) ----------------------

_CODE_NAMES = {v: k.removeprefix("NVML_ERROR_") for k, v in globals().items()
               if k.startswith("NVML_ERROR_") and isinstance(v, int)}


def _raw_error(entry: Any) -> str | None:
    """The NVML error name of a recorded answer; None for a value. A function the capture's
    pynvml lacked, or a Python exception, reads as FUNCTION_NOT_FOUND / UNKNOWN."""
    if not isinstance(entry, dict):
        return "UNKNOWN"
    if "error" in entry:
        return _CODE_NAMES.get(entry["error"]) or str(entry.get("error_name") or "UNKNOWN")
    if entry.get("missing_in_pynvml"):
        return "FUNCTION_NOT_FOUND"
    if "exception" in entry:
        return "UNKNOWN"
    return None


def _raw_field_value(answer: dict[str, Any]) -> int:
    kind, value = int(answer.get("valueType", 0)), answer.get("value") or {}
    key = {NVML_VALUE_TYPE_DOUBLE: "dVal", NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
           NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal", NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
           NVML_VALUE_TYPE_SIGNED_INT: "siVal"}.get(kind, "ullVal")
    return int(value.get(key, 0))


def _gpu_from_raw(g: dict[str, Any]) -> dict[str, Any]:
    """One GPU of nvml-raw.json as a scenario GPU. A call that answered NOT_SUPPORTED sets
    its key to null where the stand-in has one for it; any other error the stand-in can't
    derive is kept in ``errors`` under the function's name (which answers it for every
    argument of that function)."""
    errors: dict[str, str] = {}
    lost = False

    def get(key: str, function: str = "", none_ok: bool = True) -> Any:
        nonlocal lost
        entry = g.get(key, {"missing_in_pynvml": True})
        err = _raw_error(entry)
        if err is None:
            return entry["value"]
        if err == "GPU_IS_LOST":
            lost = True
        elif not (none_ok and err in ("NOT_SUPPORTED", "FUNCTION_NOT_FOUND")):
            errors.setdefault(function or key, err)
        return None

    pci = get("nvmlDeviceGetPciInfo", none_ok=False) or {}
    ecc = {f"{counter}_{kind}": get(f"nvmlDeviceGetTotalEccErrors_{kind}_{counter}",
                                    "nvmlDeviceGetTotalEccErrors")
           for kind in ("uncorrected", "corrected") for counter in ("volatile", "aggregate")}
    sbe = get("nvmlDeviceGetRetiredPages_sbe", "nvmlDeviceGetRetiredPages")
    dbe = get("nvmlDeviceGetRetiredPages_dbe", "nvmlDeviceGetRetiredPages")
    pending = get("nvmlDeviceGetRetiredPagesPendingStatus")
    remap = get("nvmlDeviceGetRemappedRows")
    v1 = get("nvmlDeviceGetMemoryInfo", none_ok=False) or {}
    v2_entry = g.get("nvmlDeviceGetMemoryInfo_v2", {"missing_in_pynvml": True})
    v2 = get("nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo")
    links: list[bool] = []
    for link in g.get("nvlink", []):
        state = link.get("state", {})
        if _raw_error(state) is not None:
            if _raw_error(state) not in ("NOT_SUPPORTED", "INVALID_ARGUMENT"):
                errors.setdefault("nvmlDeviceGetNvLinkState", str(_raw_error(state)))
            break  # past the last link, as NVML says
        links.append(bool(state["value"]))
    fields: dict[str, Any] = {}
    modelled: dict[str, tuple[str | None, int]] = {}
    recorded = g.get("field_values", {"missing_in_pynvml": True})
    if _raw_error(recorded) is not None:  # the call itself failed
        errors.setdefault("nvmlDeviceGetFieldValues", str(_raw_error(recorded)))
        recorded = {}
    for name, answer in recorded.items():
        code = int(answer["nvmlReturn"])
        err = None if code == NVML_SUCCESS else _CODE_NAMES.get(code, "UNKNOWN")
        value = _raw_field_value(answer) if err is None else 0
        field_id = globals().get(name)
        if field_id in MODELLED_FIELDS and err in (None, "NOT_SUPPORTED"):
            modelled[name] = (err, value)
        else:  # answered as recorded (also a modelled field's other errors)
            fields[name] = ({"error": err} if err else {"value": value}) | {
                "type": int(answer.get("valueType", 0))}

    def field(name: str) -> int | None:
        err, value = modelled.get(name, ("NOT_SUPPORTED", 0))
        return None if err else value

    nvlink = {key: field(FIELD_NAMES[fid]) for fid, key in _NVLINK_TOTALS.items()}
    counters = {FIELD_NAMES[fid].removeprefix(_PCIE_COUNT).lower(): field(FIELD_NAMES[fid])
                for fid in sorted(MODELLED_FIELDS) if FIELD_NAMES[fid].startswith(_PCIE_COUNT)}
    sram = get("nvmlDeviceGetSramEccErrorStatus")
    fabric_v = get("nvmlDeviceGetGpuFabricInfoV")
    fabric_v1 = get("nvmlDeviceGetGpuFabricInfo")
    fabric = fabric_v or fabric_v1
    procs = get("nvmlDeviceGetComputeRunningProcesses", none_ok=False)
    persistence = get("nvmlDeviceGetPersistenceMode")
    gpu: dict[str, Any] = {
        "name": get("nvmlDeviceGetName", none_ok=False),
        "uuid": get("nvmlDeviceGetUUID", none_ok=False),
        "serial": get("nvmlDeviceGetSerial"),
        "pci_bus_id": pci.get("busId"),
        "pci_device_id": pci.get("pciDeviceId"),
        "pci_subsystem_id": pci.get("pciSubSystemId"),
        "ecc": None if all(v is None for v in ecc.values()) else
        {k: v or 0 for k, v in ecc.items()},
        "retired_pages": None if sbe is None or dbe is None else
        {"sbe": list(sbe), "dbe": list(dbe), "pending": bool(pending)},
        "remapped_rows": None if remap is None else
        {"correctable": remap[0], "uncorrectable": remap[1], "pending": bool(remap[2]),
         "failure": bool(remap[3])},
        "throttle_reasons": get("nvmlDeviceGetCurrentClocksThrottleReasons", none_ok=False),
        "temperature_c": get("nvmlDeviceGetTemperature_gpu", "nvmlDeviceGetTemperature",
                             none_ok=False),
        "pcie": {key: get(f"nvmlDeviceGet{fn}PcieLink{what}") for key, fn, what in (
            ("gen", "Curr", "Generation"), ("gen_max", "Max", "Generation"),
            ("width", "Curr", "Width"), ("width_max", "Max", "Width"))},
        "nvlinks": len(links),
        "nvlinks_down": [i for i, up in enumerate(links) if not up],
        "memory": {"total": int(v1.get("total") or (v2 or {}).get("total") or 0),
                   "used": int((v2 or v1).get("used") or 0),
                   "reserved": int((v2 or {}).get("reserved") or 0)},
        "vbios": get("nvmlDeviceGetVbiosVersion"),
        "persistence_mode": None if persistence is None else bool(persistence),
        "nvlink_errors": None if all(v is None for v in nvlink.values()) else nvlink,
        "pcie_replay": field("NVML_FI_DEV_PCIE_REPLAY_COUNTER"),
        "recovery_action": field("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"),
        "pcie_counters": {k: v for k, v in counters.items() if v is not None} or None,
        "fields": fields,
        "sram_ecc": None if sram is None else
        {key: int(sram.get(attr, 0)) for key, attr in _SRAM_KEYS.items()} |
        {"threshold_exceeded": bool(sram.get("bThresholdExceeded"))},
        "processes": [{"pid": int(p["pid"]), "used_bytes": p.get("usedGpuMemory")}
                      for p in procs or []],
        "fabric": None if fabric is None else
        {"state": int(fabric.get("state", 0)), "status": int(fabric.get("status", 0)),
         "health_mask": int(fabric.get("healthMask", 0)),
         "health_summary": int(fabric.get("healthSummary", 0))},
        "lost": False,
        "errors": errors,
    }
    if v2 is None and _raw_error(v2_entry) in ("FUNCTION_NOT_FOUND", "NOT_SUPPORTED"):
        gpu["memory"]["v2"] = False
    if fabric_v is None and fabric_v1 is not None:
        errors.setdefault("nvmlDeviceGetGpuFabricInfoV",
                          str(_raw_error(g.get("nvmlDeviceGetGpuFabricInfoV"))))
    gpu["lost"] = lost
    return gpu


def scenario_from_nvml_raw(doc: dict[str, Any]) -> dict[str, Any]:
    """A scenario answering as the GPUs of a raw NVML capture (``nvml-raw.json`` from
    ``.ci/capture-gpu-outputs``) did, NOT_SUPPORTED calls included."""
    system = doc.get("system", {})
    return {"driver_version": (system.get("nvmlSystemGetDriverVersion") or {}).get("value"),
            "init_error": _raw_error(doc.get("init", {"value": None})),
            "hang": None,
            "gpus": [_gpu_from_raw(g) for g in doc.get("gpus", [])]}
