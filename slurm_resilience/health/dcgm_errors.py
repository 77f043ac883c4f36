"""DCGM diagnostic error codes (``dcgmError_t``) and what each asks of a node.

A failing ``dcgmi diag`` test names its errors by id (DCGM's ``dcgmlib/dcgm_errors.h``:
``DCGM_FR_*``); DCGM 4 also gives each a severity (``dcgmErrorSeverity_t``: MONITOR,
ISOLATE, TRIAGE, CONFIG, RESET) and a category. The node's answer follows from them:

* **hardware** (the GPU failed a test, or is too slow): drain; DCGM's standard advice
  is a field diagnostic;
* **reset** (an uncontained error, a pending row remap or page retirement, a volatile
  double-bit error; DCGM's RESET severity): drain, and the reason says a reset is needed;
* **setting** (persistence mode off, ECC off, a CUDA environment variable, a graphics
  process, nouveau loaded, Fabric Manager not running): a finding naming the setting and
  its fix, whose severity the site sets (``health.diag.dcgm_setting_severity``);
* **tooling** (DCGM could not run the test: a library, a permission, an API call, an
  abort): could not check, under the diag check's ``on_unknown`` policy.

An id not listed here goes by DCGM's severity where the document gives one (ISOLATE and
TRIAGE drain, RESET drains for a reset, CONFIG is a setting, MONITOR warns), else it is
taken as a hardware failure: never a pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    HARDWARE = "hardware"
    RESET = "reset"
    SETTING = "setting"
    TOOLING = "tooling"
    MONITOR = "monitor"


@dataclass(frozen=True)
class Code:
    name: str  # DCGM_FR_<name>; empty for an id not listed here
    kind: Kind
    action: str  # what to do, in a drain reason's words


_FIELD_DIAG = "run a field diagnostic"
_RESET = "drain and reset the GPU"
_H, _R, _S, _T = Kind.HARDWARE, Kind.RESET, Kind.SETTING, Kind.TOOLING

CODES: dict[int, Code] = {
    3: Code("PCI_REPLAY_RATE", _H, "check the PCIe link and seating"),
    4: Code("VOLATILE_DBE_DETECTED", _R, _RESET),
    5: Code("VOLATILE_SBE_DETECTED", _H, _FIELD_DIAG),
    6: Code("PENDING_PAGE_RETIREMENTS", _R, "reset the GPU to retire the pages"),
    7: Code("RETIRED_PAGES_LIMIT", _H, "replace the GPU (retired pages limit)"),
    8: Code("RETIRED_PAGES_DBE_LIMIT", _H, "replace the GPU (retired pages limit)"),
    9: Code("CORRUPT_INFOROM", _H, "flash the InfoROM or replace the GPU"),
    10: Code("CLOCK_THROTTLE_THERMAL", _H, "check the cooling"),
    12: Code("CLOCK_THROTTLE_POWER", _H, "check the power supply and limits"),
    13: Code("NVLINK_ERROR_THRESHOLD", _H, _FIELD_DIAG),
    14: Code("NVLINK_DOWN", _H, "check the NVLink connections, then reset"),
    15: Code("NVSWITCH_FATAL_ERROR", _R, "reset the NVSwitch and GPUs (reboot)"),
    18: Code("NO_ACCESS_TO_FILE", _T, "fix the DCGM installation"),
    20: Code("DEVICE_COUNT_MISMATCH", _H, "check that every GPU is visible"),
    22: Code("CANNOT_OPEN_LIB", _T, "fix the DCGM or driver installation"),
    23: Code("DENYLISTED_DRIVER", _S, "unload and blacklist nouveau"),
    25: Code("GRAPHICS_PROCESSES", _S, "stop the graphics processes on the GPU"),
    28: Code("BAD_CUDA_ENV", _S, "unset the CUDA environment variables DCGM names"),
    29: Code("PERSISTENCE_MODE", _S, "enable persistence mode (nvidia-smi -pm 1, or "
                                     "nvidia-persistenced)"),
    30: Code("LOW_BANDWIDTH", _H, _FIELD_DIAG),
    31: Code("HIGH_LATENCY", _H, _FIELD_DIAG),
    40: Code("THERMAL_VIOLATIONS", _H, "check the cooling"),
    42: Code("TEMP_VIOLATION", _H, "check the cooling"),
    43: Code("THROTTLING_VIOLATION", _H, "check the cooling and power"),
    44: Code("INTERNAL", _T, "rerun; report to NVIDIA if it persists"),
    45: Code("PCIE_GENERATION", _H, "check the PCIe slot and BIOS settings"),
    46: Code("PCIE_WIDTH", _H, "check the PCIe slot and seating"),
    47: Code("ABORTED", _T, "rerun the diagnostic"),
    48: Code("TEST_DISABLED", _T, "enable the test or choose another level"),
    50: Code("STRESS_LEVEL", _H, _FIELD_DIAG),
    51: Code("CUDA_API", _T, "check the CUDA installation"),
    52: Code("FAULTY_MEMORY", _H, _FIELD_DIAG),
    55: Code("ECC_DISABLED", _S, "enable ECC (nvidia-smi -e 1) and reset the GPU"),
    56: Code("MEMORY_ALLOC", _T, "free GPU memory and rerun"),
    57: Code("CUDA_DBE", _R, _RESET),
    58: Code("MEMORY_MISMATCH", _H, _FIELD_DIAG),
    59: Code("CUDA_DEVICE", _H, "check that CUDA sees every GPU"),
    62: Code("MEMORY_BANDWIDTH", _H, _FIELD_DIAG),
    63: Code("TARGET_POWER", _H, "check the power supply and limits"),
    64: Code("API_FAIL", _T, "rerun; check DCGM's logs"),
    65: Code("API_FAIL_GPU", _T, "rerun; check DCGM's logs"),
    66: Code("CUDA_CONTEXT", _H, "reset the GPU and rerun"),
    67: Code("DCGM_API", _T, "rerun; check DCGM's logs"),
    70: Code("NVLINK_CRC_ERROR_THRESHOLD", _H, _FIELD_DIAG),
    71: Code("NVLINK_ERROR_CRITICAL", _H, _FIELD_DIAG),
    72: Code("ENFORCED_POWER_LIMIT", _S, "raise the enforced power limit"),
    73: Code("MEMORY_ALLOC_HOST", _T, "free host memory and rerun"),
    79: Code("L1TAG_MISCOMPARE", _H, _FIELD_DIAG),
    80: Code("ROW_REMAP_FAILURE", _H, "replace the GPU (row remapping failed)"),
    81: Code("UNCONTAINED_ERROR", _R, _RESET),
    83: Code("DBE_PENDING_PAGE_RETIREMENTS", _R, "reset the GPU to retire the pages"),
    84: Code("UNCORRECTABLE_ROW_REMAP", _H, _FIELD_DIAG),
    85: Code("PENDING_ROW_REMAP", _R, "reset the GPU to apply the row remap"),
    86: Code("BROKEN_P2P_MEMORY_DEVICE", _H, _FIELD_DIAG),
    87: Code("BROKEN_P2P_WRITER_DEVICE", _H, _FIELD_DIAG),
    89: Code("EUD_BINARY_PERMISSIONS", _T, "fix the EUD installation"),
    90: Code("EUD_NON_ROOT_USER", _T, "run the EUD as root"),
    91: Code("EUD_SPAWN_FAILURE", _T, "fix the EUD installation"),
    92: Code("EUD_TIMEOUT", _H, _FIELD_DIAG),
    94: Code("EUD_NON_ZERO_EXIT_CODE", _H, _FIELD_DIAG),
    95: Code("EUD_TEST_FAILED", _H, _FIELD_DIAG),
    96: Code("FILE_CREATE_PERMISSIONS", _T, "fix DCGM's working directory permissions"),
    98: Code("PCIE_H_REPLAY_VIOLATION", _H, "check the PCIe link and seating"),
    99: Code("GPU_EXPECTED_NVLINKS_UP", _H, "check the NVLink connections"),
    100: Code("NVSWITCH_EXPECTED_NVLINKS_UP", _H, "check the NVSwitch connections"),
    101: Code("XID_ERROR", _H, "follow the Xid's action (see the xid check)"),
    102: Code("SBE_VIOLATION", _H, _FIELD_DIAG),
    103: Code("DBE_VIOLATION", _R, _RESET),
    104: Code("PCIE_REPLAY_VIOLATION", _H, "check the PCIe link and seating"),
    105: Code("SBE_THRESHOLD_VIOLATION", _H, _FIELD_DIAG),
    106: Code("DBE_THRESHOLD_VIOLATION", _R, _RESET),
    107: Code("PCIE_REPLAY_THRESHOLD_VIOLATION", _H, "check the PCIe link and seating"),
    108: Code("CUDA_FM_NOT_INITIALIZED", _S, "start nvidia-fabricmanager"),
    109: Code("SXID_ERROR", _R, "reset the NVSwitch and GPUs (reboot)"),
    110: Code("GFLOPS_THRESHOLD_VIOLATION", _H, _FIELD_DIAG),
    111: Code("NAN_VALUE", _H, _FIELD_DIAG),
}

# dcgmErrorSeverity_t: 1 MONITOR, 2 ISOLATE, 3 UNKNOWN, 4 TRIAGE, 5 CONFIG, 6 RESET.
_BY_SEVERITY = {1: Kind.MONITOR, 2: Kind.HARDWARE, 3: Kind.HARDWARE, 4: Kind.HARDWARE,
                5: Kind.SETTING, 6: Kind.RESET}
_ORDER = (Kind.MONITOR, Kind.TOOLING, Kind.SETTING, Kind.HARDWARE, Kind.RESET)


def code(error_id: int, severity: int | None = None) -> Code:
    """What ``error_id`` asks for; an unlisted id by DCGM's severity, else hardware."""
    known = CODES.get(error_id)
    if known is not None:
        return known
    kind = _BY_SEVERITY.get(severity or 0, Kind.HARDWARE)
    action = {Kind.RESET: _RESET, Kind.SETTING: "fix the configuration DCGM names",
              Kind.MONITOR: "watch the GPU"}.get(kind, _FIELD_DIAG)
    return Code("", kind, action)


def worst(codes: list[Code]) -> Code:
    """The code that decides a result with several errors."""
    return max(codes, key=lambda c: _ORDER.index(c.kind))
