"""Scenarios for the NVML stand-in (:mod:`.nvml`) built from real captures, so the
stand-in is checked against reality: :func:`scenario_from_nvidia_smi` from
``nvidia-smi -q`` output, :func:`scenario_from_nvml_raw` from a raw NVML capture
(``nvml-raw.json`` from ``.ci/capture-gpu-outputs``: every call's answer or NVMLError
code)."""

from __future__ import annotations

import copy
import re
import uuid
from typing import Any

from slurm_resilience.fakes import nvml as N
from slurm_resilience.fakes import nvml_fabric

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
    "Idle": N.nvmlClocksThrottleReasonGpuIdle,
    "Applications Clocks Setting": N.nvmlClocksThrottleReasonApplicationsClocksSetting,
    "SW Power Cap": N.nvmlClocksThrottleReasonSwPowerCap,
    "HW Slowdown": N.nvmlClocksThrottleReasonHwSlowdown,
    "HW Thermal Slowdown": N.nvmlClocksThrottleReasonHwThermalSlowdown,
    "HW Power Brake Slowdown": N.nvmlClocksThrottleReasonHwPowerBrakeSlowdown,
    "Sync Boost": N.nvmlClocksThrottleReasonSyncBoost,
    "SW Thermal Slowdown": N.nvmlClocksThrottleReasonSwThermalSlowdown,
    "Display Clock Setting": N.nvmlClocksThrottleReasonDisplayClockSetting,
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


_RECOVERY = {"None": N.NVML_GPU_RECOVERY_ACTION_NONE,
             "GPU Reset": N.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
             "Node Reboot": N.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT,
             "Drain P2P": N.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P,
             "Drain and Reset": N.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET}


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
        health = fabric.get("Health")
        gpu["fabric"] = nvml_fabric.entry(
            {k.lower(): str(v) for k, v in fabric.items() if not isinstance(v, dict)},
            {k.lower(): str(v) for k, v in health.items()} if isinstance(health, dict) else {})
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

_CODE_NAMES = {v: k.removeprefix("NVML_ERROR_") for k, v in vars(N).items()
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
    key = {N.NVML_VALUE_TYPE_DOUBLE: "dVal", N.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
           N.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal", N.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
           N.NVML_VALUE_TYPE_SIGNED_INT: "siVal"}.get(kind, "ullVal")
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
        err = None if code == N.NVML_SUCCESS else _CODE_NAMES.get(code, "UNKNOWN")
        value = _raw_field_value(answer) if err is None else 0
        field_id = vars(N).get(name)
        if field_id in N.MODELLED_FIELDS and err in (None, "NOT_SUPPORTED"):
            modelled[name] = (err, value)
        else:  # answered as recorded (also a modelled field's other errors)
            fields[name] = ({"error": err} if err else {"value": value}) | {
                "type": int(answer.get("valueType", 0))}

    def field(name: str) -> int | None:
        err, value = modelled.get(name, ("NOT_SUPPORTED", 0))
        return None if err else value

    nvlink = {key: field(N.FIELD_NAMES[fid]) for fid, key in N.NVLINK_TOTALS.items()}
    counters = {N.FIELD_NAMES[fid].removeprefix(N.PCIE_COUNT).lower(): field(N.FIELD_NAMES[fid])
                for fid in sorted(N.MODELLED_FIELDS)
                if N.FIELD_NAMES[fid].startswith(N.PCIE_COUNT)}
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
        {key: int(sram.get(attr, 0)) for key, attr in N.SRAM_KEYS.items()} |
        {"threshold_exceeded": bool(sram.get("bThresholdExceeded"))},
        "processes": [{"pid": int(p["pid"]), "used_bytes": p.get("usedGpuMemory")}
                      for p in procs or []],
        "fabric": None if fabric is None else
        {"state": int(fabric.get("state", 0)), "status": int(fabric.get("status", 0)),
         "health_mask": int(fabric.get("healthMask", 0)),
         "health_summary": int(fabric.get("healthSummary", 0)),
         "clique_id": int(fabric.get("cliqueId", 0)),
         "cluster_uuid": str(uuid.UUID(bytes=bytes(fabric.get("clusterUuid", [0] * 16)[:16])))},
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
