"""``slurm-resilience sandbox inject NODE FAULT`` and ``heal NODE``: break stand-in hardware.

Faults change the node's stand-ins the way the real failure shows up:

* ``gpu-xid:GPU:XID`` logs an NVRM Xid line for the GPU's PCI address in the
  node's kmsg; for Xid 79 the GPU also becomes lost (NVML answers GPU_IS_LOST),
  as a GPU that fell off the bus does.
* ``gpu-ecc:GPU`` one volatile uncorrectable ECC error, and Xid 48 in the log.
* ``gpu-missing:GPU`` the GPU disappears from NVML (the count drops).
* ``gpu-throttle:GPU:REASON`` REASON in hw_thermal, hw_slowdown, hw_power_brake, sw_thermal.
* ``gpu-remap-pending:GPU`` a row waiting for remapping (and Xid 63).
* ``ib-down:HCA:PORT`` port DOWN/Disabled; ``ib-errors:HCA:PORT`` symbol errors jump by 1000.
* ``nvme-full`` a sparse file as big as the node's configured disk size
  (``health.nvme.size_limit``, which the sandbox sets) fills the stand-in NVMe.

:data:`FAULTS` is a registry: other modules add their own (``nccl-*``) with
:func:`register`. ``heal`` puts every stand-in back to healthy, as a reboot
would (a new boot id, so earlier Xids are history).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurm_resilience.fakes import kmsg, nvml, sysfs
from slurm_resilience.sandbox import hardware

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


def _port(hw: hardware.NodeHardware, args: list[str]) -> tuple[str, int]:
    hca, port = args[0], _int(args[1], "PORT")
    if not (hw.sysfs / hca / "ports" / str(port)).is_dir():
        raise FaultError(f"{hw.node} has no {hca} port {port}")
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


register("gpu-xid", "gpu-xid:GPU:XID", gpu_xid)
register("gpu-ecc", "gpu-ecc:GPU", gpu_ecc)
register("gpu-missing", "gpu-missing:GPU", gpu_missing)
register("gpu-throttle", "gpu-throttle:GPU:hw_thermal", gpu_throttle)
register("gpu-remap-pending", "gpu-remap-pending:GPU", gpu_remap_pending)
register("ib-down", "ib-down:HCA:PORT", ib_down)
register("ib-errors", "ib-errors:HCA:PORT", ib_errors)
register("nvme-full", "nvme-full", nvme_full)


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
    hw = hardware.locate(state_dir, node)
    if not hw.root.is_dir():
        raise FaultError(f"no sandbox node {node!r} in {state_dir}")
    return f"{node}: {fn(hw, args)}"


def heal(state_dir: Path, node: str) -> str:
    hw = hardware.locate(state_dir, node)
    if not hw.root.is_dir():
        raise FaultError(f"no sandbox node {node!r} in {state_dir}")
    hardware.reset_node(hw)
    for healer in HEALERS:
        healer(hw)
    return f"{node}: stand-in hardware healthy again (as after a reboot)"


# Faults of other capabilities register themselves (last: they call register()).
import slurm_resilience.nccl.sandbox_faults  # noqa: E402, F401
from slurm_resilience.stragglers import sandbox_faults as _stragglers  # noqa: E402, F401
