"""``slurm-resilience sandbox inject NODE FAULT`` and ``heal NODE``: break stand-in hardware.

Faults change the node's stand-ins the way the real failure shows up:

* ``gpu-xid:GPU:XID`` logs an NVRM Xid line for the GPU's PCI address in the
  node's kmsg; for Xid 79 the GPU also becomes lost (NVML answers GPU_IS_LOST),
  as a GPU that fell off the bus does.
* ``gpu-reset:GPU`` resets the GPU without a reboot (a lost GPU answers again).
* ``gpu-ecc:GPU`` one volatile uncorrectable ECC error, and Xid 48 in the log.
* ``gpu-missing:GPU`` the GPU disappears from NVML (the count drops).
* ``gpu-throttle:GPU:REASON`` REASON in hw_thermal, hw_slowdown, hw_power_brake, sw_thermal.
* ``gpu-remap-pending:GPU`` a row waiting for remapping (and Xid 63).
* ``ib-down:HCA:PORT`` port DOWN/Disabled; ``ib-errors:HCA:PORT`` symbol errors jump by 1000.
* ``kernel-log:SIGNAL`` logs a host-signal line in the node's kmsg: SIGNAL in
  nvme-io-error, readonly-remount, soft-lockup, hard-lockup, mce, sxid (a fatal NVSwitch SXid).
* ``nvlink-errors:GPU`` the GPU's NVLink replay total jumps by 1000 and recovery by 1
  (judged as a rise between runs, like the IB counters).
* ``gpu-recovery:GPU`` NVML's recovery action becomes DRAIN_AND_RESET.
* ``sram-ecc:GPU`` one SRAM uncorrectable error and the threshold-exceeded flag.
* ``hbm-degraded:GPU`` the GPU's corrected ECC count jumps by 100000 and a row is
  remapped (correctable): memory that corrects ever more before it fails.
* ``fabric-unhealthy`` every GPU's fabric health (NVML V3) turns UNHEALTHY with degraded
  bandwidth, as on a GB200 NVL72 tray whose NVLink switch tray lost links.
* ``nvme-full`` a sparse file as big as the node's configured disk size
  (``health.nvme.size_limit``, which the sandbox sets) fills the stand-in NVMe.
* ``pcie-aer:GPU`` one non-fatal uncorrectable PCIe error (a completion timeout,
  ``CmpltTO``) in the GPU's sysfs AER statistics (``aer_dev_nonfatal``).
* ``pcie-replay:GPU`` NVML's PCIe replay counter (``NVML_FI_DEV_PCIE_REPLAY_COUNTER``)
  jumps by 100000: a link retransmitting (judged as a rate between runs).
* ``gpu-persistence-off:GPU`` persistence mode disabled (``nvidia-smi -pm 0``).
* ``gpu-vbios:GPU`` the GPU runs another VBIOS than its peers (a board swapped in from
  spares); fails where ``health.gpu.uniform_vbios`` is ``fail`` (warns by default).
* ``gpu-driver:VERSION`` the node's driver is VERSION (an image that drifted); fails
  against ``health.gpu.expected_driver``, which the sandbox sets to ``565.``.
* ``peermem-unloaded`` ``rmmod nvidia_peermem``: gone from the node's ``/proc/modules``
  (the sandbox requires it, ``health.gpu.peermem: required``).
* ``mount-unreachable`` the node's shared filesystem path (``health.mounts.paths``)
  answers ENOENT, as an autofs path whose server refused the mount does.
* ``nvme-media-errors`` the NVMe's SMART log counts 7 media errors (as the real
  failing Samsung 970 EVO capture), read through the ``nvme smart-log`` stand-in.
* ``nvme-spare-low`` the NVMe's available spare drops to 10%: above the drive's own
  threshold (5%, so no critical warning) but under the sandbox's floor
  (``health.nvme.min_available_spare: 20``).
* ``service-failed:UNIT`` a GPU service unit (nvidia-fabricmanager, nvidia-persistenced)
  is ``failed``, as ``systemctl is-active`` reports it.
* ``ib-missing:HCA`` the HCA vanishes from ``/sys/class/infiniband`` (the driver
  unbound it after a fatal error); caught by the shipped per-GPU-model HCA count.
* ``ib-downtrained:HCA:PORT`` the port is ACTIVE/LinkUp at ``200 Gb/sec (2X NDR)``
  (lanes lost); caught by the shipped per-GPU-model minimum rate.

:data:`FAULTS` is a registry: other modules add their own (``nccl-*``) with
:func:`register`. ``heal`` puts every stand-in back to healthy, as a reboot
would (a new boot id, so earlier Xids are history).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurm_resilience.fakes import kmsg, nvml, sysfs
from slurm_resilience.sandbox import hardware, standins

FaultFn = Callable[[hardware.NodeHardware, list[str]], str]
FAULTS: dict[str, tuple[str, FaultFn]] = {}
HEALERS: list[Callable[[hardware.NodeHardware], None]] = []

_THROTTLE = {
    "hw_thermal": nvml.nvmlClocksThrottleReasonHwThermalSlowdown
    | nvml.nvmlClocksThrottleReasonHwSlowdown,
    "hw_power_brake": nvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown
    | nvml.nvmlClocksThrottleReasonHwSlowdown,
    "hw_slowdown": nvml.nvmlClocksThrottleReasonHwSlowdown,
    "sw_thermal": nvml.nvmlClocksThrottleReasonSwThermalSlowdown,
}


class FaultError(ValueError):
    """A fault name or argument that cannot be applied; the message says what is valid."""


def register(name: str, usage: str, fn: FaultFn) -> None:
    """Add a fault kind; ``usage`` is shown in errors (e.g. ``gpu-xid:GPU:XID``)."""
    FAULTS[name] = (usage, fn)


def register_healer(fn: Callable[[hardware.NodeHardware], None]) -> None:
    HEALERS.append(fn)


def _int(text: str, what: str) -> int:
    if not text.isdigit():
        raise FaultError(f"{what} must be a number, got {text!r}")
    return int(text)


def _edit_gpu(hw: hardware.NodeHardware, index: int,
              change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    scenario = nvml.read_scenario(str(hw.scenario)) or nvml.default_scenario(hardware.GPUS)
    gpus = scenario["gpus"]
    if index >= len(gpus):
        raise FaultError(f"{hw.node} has GPUs 0..{len(gpus) - 1}, not {index}")
    gpu: dict[str, Any] = gpus[index]
    change(gpu)
    nvml.write_scenario(str(hw.scenario), scenario)
    return gpu


def gpu_xid(hw: hardware.NodeHardware, args: list[str]) -> str:
    index, xid = _int(args[0], "GPU"), _int(args[1], "XID")

    def change(gpu: dict[str, Any]) -> None:
        if xid == 79:
            gpu["lost"] = True

    gpu = _edit_gpu(hw, index, change)
    kmsg.append_xid(str(hw.kmsg), gpu["pci_bus_id"], xid)
    return f"gpu{index} Xid {xid} logged" + (" and GPU lost" if xid == 79 else "")


def gpu_reset(hw: hardware.NodeHardware, args: list[str]) -> str:
    """``nvidia-smi -r``: a lost GPU answers again and its volatile counters restart."""
    index = _int(args[0], "GPU")

    def change(gpu: dict[str, Any]) -> None:
        gpu["lost"] = False
        gpu["ecc"]["volatile_uncorrected"] = 0

    _edit_gpu(hw, index, change)
    return f"gpu{index} reset (no reboot)"


def gpu_ecc(hw: hardware.NodeHardware, args: list[str]) -> str:
    index = _int(args[0], "GPU")

    def change(gpu: dict[str, Any]) -> None:
        gpu["ecc"]["volatile_uncorrected"] += 1
        gpu["ecc"]["aggregate_uncorrected"] += 1

    gpu = _edit_gpu(hw, index, change)
    kmsg.append_xid(str(hw.kmsg), gpu["pci_bus_id"], 48)
    return f"gpu{index} uncorrectable ECC error (Xid 48)"


def gpu_missing(hw: hardware.NodeHardware, args: list[str]) -> str:
    index = _int(args[0], "GPU")
    scenario = nvml.read_scenario(str(hw.scenario)) or nvml.default_scenario(hardware.GPUS)
    if index >= len(scenario["gpus"]):
        raise FaultError(f"{hw.node} has GPUs 0..{len(scenario['gpus']) - 1}, not {index}")
    del scenario["gpus"][index]
    nvml.write_scenario(str(hw.scenario), scenario)
    return f"gpu{index} gone from NVML ({len(scenario['gpus'])} left)"


def gpu_throttle(hw: hardware.NodeHardware, args: list[str]) -> str:
    index, reason = _int(args[0], "GPU"), args[1]
    if reason not in _THROTTLE:
        raise FaultError(f"throttle reason {reason!r}; valid: {', '.join(_THROTTLE)}")

    def change(gpu: dict[str, Any]) -> None:
        gpu["throttle_reasons"] = (gpu["throttle_reasons"] & ~1) | _THROTTLE[reason]

    _edit_gpu(hw, index, change)
    return f"gpu{index} throttled: {reason}"


def gpu_remap_pending(hw: hardware.NodeHardware, args: list[str]) -> str:
    index = _int(args[0], "GPU")

    def change(gpu: dict[str, Any]) -> None:
        gpu["remapped_rows"]["uncorrectable"] += 1
        gpu["remapped_rows"]["pending"] = True

    gpu = _edit_gpu(hw, index, change)
    kmsg.append_xid(str(hw.kmsg), gpu["pci_bus_id"], 63)
    return f"gpu{index} row remap pending (Xid 63)"


def _hcas(hw: hardware.NodeHardware) -> str:
    """The node's HCAs with their ports, for an error that lists the valid names."""
    found = sorted(p.name for p in hw.sysfs.iterdir() if p.is_dir()) if hw.sysfs.is_dir() else []
    ports = {h: sorted(p.name for p in (hw.sysfs / h / "ports").iterdir())
             if (hw.sysfs / h / "ports").is_dir() else [] for h in found}
    return ", ".join(f"{h} (ports {','.join(ports[h])})" for h in found) or "none"


def _port(hw: hardware.NodeHardware, args: list[str]) -> tuple[str, int]:
    hca, port = args[0], _int(args[1], "PORT")
    if not (hw.sysfs / hca / "ports" / str(port)).is_dir():
        raise FaultError(f"{hw.node} has no {hca} port {port}; valid: {_hcas(hw)}")
    return hca, port


def ib_down(hw: hardware.NodeHardware, args: list[str]) -> str:
    hca, port = _port(hw, args)
    sysfs.port_down(str(hw.sysfs), hca, port)
    sysfs.add_to_counter(str(hw.sysfs), hca, port, "link_downed", 1)
    return f"{hca} port{port} DOWN/Disabled"


def ib_errors(hw: hardware.NodeHardware, args: list[str]) -> str:
    hca, port = _port(hw, args)
    value = sysfs.add_to_counter(str(hw.sysfs), hca, port, "symbol_error", 1000)
    return f"{hca} port{port} symbol_error now {value}"


def nvme_full(hw: hardware.NodeHardware, args: list[str]) -> str:
    fill = hw.nvme / hardware.FILL_FILE
    with open(fill, "wb") as fh:
        fh.truncate(hardware.NVME_SIZE)  # sparse: counts against size_limit, costs no disk
    return f"{hw.nvme} filled to its {hardware.NVME_SIZE >> 30} GiB size limit"


def kernel_log(hw: hardware.NodeHardware, args: list[str]) -> str:
    line = kmsg.HOST_SIGNAL_LINES.get(args[0])
    if line is None:
        raise FaultError(f"kernel-log signal must be one of {', '.join(kmsg.HOST_SIGNAL_LINES)}")
    kmsg.append(str(hw.kmsg), line, priority=2)
    return f"kernel log: {line}"


def nvlink_errors(hw: hardware.NodeHardware, args: list[str]) -> str:
    index = _int(args[0], "GPU")

    def change(gpu: dict[str, Any]) -> None:
        links = gpu.setdefault("nvlink_errors", {})
        links["replay"] = int(links.get("replay") or 0) + 1000
        links["recovery"] = int(links.get("recovery") or 0) + 1

    _edit_gpu(hw, index, change)
    return f"gpu{index} NVLink replay +1000, recovery +1"


def gpu_recovery(hw: hardware.NodeHardware, args: list[str]) -> str:
    index = _int(args[0], "GPU")

    def change(gpu: dict[str, Any]) -> None:
        gpu["recovery_action"] = nvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET

    _edit_gpu(hw, index, change)
    return f"gpu{index} NVML recovery action DRAIN_AND_RESET"


def sram_ecc(hw: hardware.NodeHardware, args: list[str]) -> str:
    index = _int(args[0], "GPU")

    def change(gpu: dict[str, Any]) -> None:
        sram = gpu.setdefault("sram_ecc", {})
        sram["aggregate_unc_secded"] = int(sram.get("aggregate_unc_secded") or 0) + 1
        sram["threshold_exceeded"] = True

    _edit_gpu(hw, index, change)
    return f"gpu{index} SRAM uncorrectable error, threshold exceeded"


def hbm_degraded(hw: hardware.NodeHardware, args: list[str]) -> str:
    index = _int(args[0], "GPU")

    def change(gpu: dict[str, Any]) -> None:
        ecc = gpu.setdefault("ecc", {})
        for key in ("volatile_corrected", "aggregate_corrected"):
            ecc[key] = int(ecc.get(key) or 0) + 100000
        rows = gpu.get("remapped_rows")
        if rows is not None:
            rows["correctable"] += 1

    _edit_gpu(hw, index, change)
    return f"gpu{index} corrected ECC +100000, one more row remapped"


def fabric_unhealthy(hw: hardware.NodeHardware, args: list[str]) -> str:
    scenario = nvml.read_scenario(str(hw.scenario)) or nvml.default_scenario(hardware.GPUS)
    mask = (nvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
            << nvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW)
    for gpu in scenario["gpus"]:
        fabric = gpu.get("fabric") or {"state": nvml.NVML_GPU_FABRIC_STATE_COMPLETED,
                                       "status": nvml.NVML_SUCCESS}
        fabric.update(health_mask=mask,
                      health_summary=nvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY)
        gpu["fabric"] = fabric
    nvml.write_scenario(str(hw.scenario), scenario)
    return "fabric health UNHEALTHY (degraded bandwidth) on every GPU"


def pcie_aer(hw: hardware.NodeHardware, args: list[str]) -> str:
    index = _int(args[0], "GPU")
    gpu = _edit_gpu(hw, index, lambda gpu: None)
    bdf = sysfs.sysfs_bdf(gpu["pci_bus_id"])
    total = sysfs.add_aer(str(hw.pci), bdf, "nonfatal", "CmpltTO", 1)
    return f"gpu{index} ({bdf}) PCIe AER non-fatal CmpltTO +1 (TOTAL_ERR_NONFATAL {total})"


# Replays a flaky link adds: the rate is judged since the last change of the counter, which
# in a long-running sandbox may be hours ago (8/min allowed), so the burst is large.
REPLAY_BURST = 100000


def pcie_replay(hw: hardware.NodeHardware, args: list[str]) -> str:
    index = _int(args[0], "GPU")

    def change(gpu: dict[str, Any]) -> None:
        gpu["pcie_replay"] = int(gpu.get("pcie_replay") or 0) + REPLAY_BURST

    gpu = _edit_gpu(hw, index, change)
    return f"gpu{index} PCIe replay counter now {gpu['pcie_replay']}"


def gpu_persistence_off(hw: hardware.NodeHardware, args: list[str]) -> str:
    index = _int(args[0], "GPU")

    def change(gpu: dict[str, Any]) -> None:
        gpu["persistence_mode"] = False

    _edit_gpu(hw, index, change)
    return f"gpu{index} persistence mode disabled"


# Another H100 VBIOS than default_gpu's 96.00.74.00.01 (an older board from spares).
OTHER_VBIOS = "96.00.61.00.01"


def gpu_vbios(hw: hardware.NodeHardware, args: list[str]) -> str:
    index = _int(args[0], "GPU")

    def change(gpu: dict[str, Any]) -> None:
        gpu["vbios"] = OTHER_VBIOS

    _edit_gpu(hw, index, change)
    return f"gpu{index} VBIOS now {OTHER_VBIOS}"


def gpu_driver(hw: hardware.NodeHardware, args: list[str]) -> str:
    version = args[0]
    if not version or not all(part.isdigit() for part in version.split(".")):
        raise FaultError(f"driver VERSION like 550.127.05, got {version!r}")
    scenario = nvml.read_scenario(str(hw.scenario)) or nvml.default_scenario(hardware.GPUS)
    scenario["driver_version"] = version
    nvml.write_scenario(str(hw.scenario), scenario)
    return f"driver {version} loaded"


def peermem_unloaded(hw: hardware.NodeHardware, args: list[str]) -> str:
    hardware.replace_text(hw.modules, standins.proc_modules(peermem=False))
    return "nvidia_peermem unloaded (rmmod)"


def mount_unreachable(hw: hardware.NodeHardware, args: list[str]) -> str:
    if hw.shared.is_dir():
        gone = hw.shared.with_name(f".{hw.shared.name}.gone-{os.getpid()}")
        os.rename(hw.shared, gone)  # one step: a probe sees the path or ENOENT
        shutil.rmtree(gone)
    return f"{hw.shared} unreachable (ENOENT)"


def _smart(hw: hardware.NodeHardware, **changes: int) -> dict[str, Any]:
    log: dict[str, Any] = json.loads(hw.smart_log.read_text())
    for key, value in changes.items():
        log[key] = int(log.get(key) or 0) + value if key.endswith("errors") else value
    hardware.replace_text(hw.smart_log, json.dumps(log, indent=2) + "\n")
    return log


def nvme_media_errors(hw: hardware.NodeHardware, args: list[str]) -> str:
    log = _smart(hw, media_errors=7)
    return f"NVMe SMART media_errors now {log['media_errors']}"


def nvme_spare_low(hw: hardware.NodeHardware, args: list[str]) -> str:
    log = _smart(hw, avail_spare=10)
    return f"NVMe SMART avail_spare {log['avail_spare']}% (drive threshold {log['spare_thresh']}%)"


def service_failed(hw: hardware.NodeHardware, args: list[str]) -> str:
    unit = args[0].removesuffix(".service")
    if unit not in standins.UNITS:
        raise FaultError(f"unit must be one of {', '.join(standins.UNITS)}, not {unit!r}")
    hardware.replace_text(hw.units / unit, "failed\n")
    return f"{unit}.service failed"


def ib_missing(hw: hardware.NodeHardware, args: list[str]) -> str:
    hca = args[0]
    if not (hw.sysfs / hca).is_dir():
        raise FaultError(f"{hw.node} has no {hca}; valid: {_hcas(hw)}")
    gone = hw.sysfs.parent / f".{hca}.gone-{os.getpid()}"
    os.rename(hw.sysfs / hca, gone)  # one step, as the device leaves the class at once
    shutil.rmtree(gone)
    return f"{hca} gone from {hw.sysfs}"


def ib_downtrained(hw: hardware.NodeHardware, args: list[str]) -> str:
    hca, port = _port(hw, args)
    sysfs.set_port(str(hw.sysfs), hca, port, state="ACTIVE", phys_state="LinkUp",
                   rate=sysfs.RATE_NDR_2X)
    return f"{hca} port{port} ACTIVE at {sysfs.RATE_NDR_2X}"


register("gpu-xid", "gpu-xid:GPU:XID", gpu_xid)
register("gpu-reset", "gpu-reset:GPU", gpu_reset)
register("kernel-log", "kernel-log:SIGNAL", kernel_log)
register("gpu-ecc", "gpu-ecc:GPU", gpu_ecc)
register("gpu-missing", "gpu-missing:GPU", gpu_missing)
register("gpu-throttle", "gpu-throttle:GPU:hw_thermal", gpu_throttle)
register("gpu-remap-pending", "gpu-remap-pending:GPU", gpu_remap_pending)
register("ib-down", "ib-down:HCA:PORT", ib_down)
register("ib-errors", "ib-errors:HCA:PORT", ib_errors)
register("nvme-full", "nvme-full", nvme_full)
register("nvlink-errors", "nvlink-errors:GPU", nvlink_errors)
register("gpu-recovery", "gpu-recovery:GPU", gpu_recovery)
register("sram-ecc", "sram-ecc:GPU", sram_ecc)
register("fabric-unhealthy", "fabric-unhealthy", fabric_unhealthy)
register("hbm-degraded", "hbm-degraded:GPU", hbm_degraded)
register("pcie-aer", "pcie-aer:GPU", pcie_aer)
register("pcie-replay", "pcie-replay:GPU", pcie_replay)
register("gpu-persistence-off", "gpu-persistence-off:GPU", gpu_persistence_off)
register("gpu-vbios", "gpu-vbios:GPU", gpu_vbios)
register("gpu-driver", "gpu-driver:VERSION", gpu_driver)
register("peermem-unloaded", "peermem-unloaded", peermem_unloaded)
register("mount-unreachable", "mount-unreachable", mount_unreachable)
register("nvme-media-errors", "nvme-media-errors", nvme_media_errors)
register("nvme-spare-low", "nvme-spare-low", nvme_spare_low)
register("service-failed", "service-failed:UNIT", service_failed)
register("ib-missing", "ib-missing:HCA", ib_missing)
register("ib-downtrained", "ib-downtrained:HCA:PORT", ib_downtrained)


def usages() -> str:
    return ", ".join(u for u, _ in FAULTS.values())


def inject(state_dir: Path, node: str, fault: str) -> str:
    """Apply one fault to ``node``'s stand-ins; returns what was done."""
    name, *args = fault.split(":")
    if name not in FAULTS:
        raise FaultError(f"unknown fault {fault!r}; valid: {usages()}")
    usage, fn = FAULTS[name]
    if len(args) != usage.count(":"):
        raise FaultError(f"fault {fault!r}: expected {usage}")
    hw = _node(state_dir, node)
    return f"{node}: {fn(hw, args)}"


def _node(state_dir: Path, node: str) -> hardware.NodeHardware:
    hw = hardware.locate(state_dir, node)
    if not hw.root.is_dir():
        known = sorted(p.name for p in hw.root.parent.iterdir()) if hw.root.parent.is_dir() \
            else []
        raise FaultError(f"no sandbox node {node!r} in {state_dir}; valid: "
                         f"{', '.join(known) or 'none (is the sandbox up?)'}")
    return hw


def heal(state_dir: Path, node: str) -> str:
    hw = _node(state_dir, node)
    hardware.reset_node(hw)
    for healer in HEALERS:
        healer(hw)
    return f"{node}: stand-in hardware healthy again (as after a reboot)"


# Faults of other capabilities register themselves (last: they call register()).
import slurm_resilience.sandbox.nccl_faults  # noqa: E402
import slurm_resilience.sandbox.straggler_faults  # noqa: E402, F401
