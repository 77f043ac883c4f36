"""Write kernel-log lines the way ``/dev/kmsg`` hands them out.

A ``/dev/kmsg`` record is ``<priority>,<sequence>,<microseconds since boot>,<flags>;<message>``
(the kernel's Documentation/ABI/testing/dev-kmsg). The NVIDIA driver logs Xids at
warning level (priority 4) with messages such as
``NVRM: Xid (PCI:0000:9b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.``
"""

from __future__ import annotations

import os
import time

from slurm_resilience.health.collectors.xid import boot_time

XID_TEXT = {
    79: "GPU has fallen off the bus.",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
        "at physAddr 0x12bac1c3e0 partition 2, subpartition 1.",
    63: "Row Remapper: New row (0x00000012bac1c3e0) marked for remapping, reset gpu to "
        "activate.",
    13: "Graphics SM Warp Exception on (GPC 8, TPC 5, SM 0): Out Of Range Address",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU4 GSP! Expected function 76 "
         "(GSP_RM_CONTROL) (0x20801813 0x4c).",
}


# One line per host signal, as the kernel prints it (see health/collectors/host_signals.py).
HOST_SIGNAL_LINES = {
    "nvme-io-error": "I/O error, dev nvme0n1, sector 1953523712 op 0x0:(READ) flags 0x80700 "
                     "phys_seg 1 prio class 0",
    "readonly-remount": "EXT4-fs (nvme0n1p1): Remounting filesystem read-only",
    "soft-lockup": "watchdog: BUG: soft lockup - CPU#17 stuck for 23s! [python:81234]",
    "hard-lockup": "NMI watchdog: Watchdog detected hard LOCKUP on cpu 33",
    "mce": "mce: Uncorrected hardware memory error in user-access at 3c5a1e2000",
    "sxid": "nvidia-nvswitch3: SXid (PCI:0000:08:00.0): 24007, Fatal, Link 44 sourcetrack "
            "TCEN0 crumbstore ECC DBE Error (First)",
    "pcie-aer": "pcieport 0000:97:01.0: AER: Uncorrected (Non-Fatal) error received: "
                "0000:9b:00.0",
}


def kernel_pci(nvml_bus_id: str) -> str:
    """``00000000:9B:00.0`` (NVML) → ``0000:9b:00`` (how NVRM prints it)."""
    dom, bus, dev = nvml_bus_id.lower().split(".")[0].split(":")
    return f"{int(dom, 16):04x}:{bus}:{dev}"


def xid_message(pci: str, xid: int, text: str | None = None) -> str:
    body = text or XID_TEXT.get(xid, "Ch 00000008")
    return f"NVRM: Xid (PCI:{pci}): {xid}, pid='<unknown>', name=<unknown>, {body}"


def _next_seq(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as fh:
            last = 0
            for line in fh:
                head = line.split(";", 1)[0].split(",")
                if len(head) >= 2 and head[1].isdigit():
                    last = int(head[1])
            return last + 1
    except FileNotFoundError:
        return 1


def append(path: str, message: str, *, priority: int = 4, when: float | None = None) -> str:
    """Append one record; the timestamp is microseconds since this machine's boot."""
    stamp = time.time() if when is None else when
    usec = max(0, int((stamp - boot_time()) * 1e6))
    record = f"{priority},{_next_seq(path)},{usec},-;{message}"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(record + "\n")
    return record


def append_xid(path: str, nvml_bus_id: str, xid: int, text: str | None = None,
               when: float | None = None) -> str:
    return append(path, xid_message(kernel_pci(nvml_bus_id), xid, text), when=when)
