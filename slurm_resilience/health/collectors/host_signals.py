"""Host failures the kernel log names: NVMe I/O errors, read-only remounts, lockups, MCE,
PCIe AER errors and NVSwitch SXids.

Each pattern matches the line the kernel itself prints (message formats from the
kernel sources: block/blk-core.c, drivers/nvme/host/core.c, fs/ext4/super.c,
fs/xfs/xfs_fsops.c, fs/btrfs, kernel/watchdog.c, arch/x86/kernel/cpu/mce,
drivers/edac; SXids: the NVSwitch driver's ``nvidia-nvswitchN: SXid (PCI:0000:05:00.0):
12028, Non-fatal, Link 32 ...`` as listed in NVIDIA's Fabric Manager guide, whose
follow-up ``SXid (PCI:...): 11004, Severity 0 Engine instance ...`` detail lines are not
events of their own). A machine check prints a burst of ``[Hardware Error]`` detail lines
per event; only the one summary line of an event is matched, so an event counts once.
PCIe AER (drivers/pci/pcie/aer.c) is the same: the port's ``AER: Uncorrected (Non-Fatal)
error received: 0000:09:00.0`` line (``Uncorrectable ... error message received from``
on kernels 6.x, ``Multiple ...`` for several) names the device and the class; the
``PCIe Bus Error: severity=...``, ``device [...] error status/mask``, ``[20] UnsupReq``
and ``TLP Header`` lines after it describe that one event.
"""

from __future__ import annotations

import enum
import re


class HostSignal(enum.Enum):
    NVME_IO_ERROR = "nvme-io-error"
    READONLY_REMOUNT = "readonly-remount"
    SOFT_LOCKUP = "soft-lockup"
    HARD_LOCKUP = "hard-lockup"
    MCE_CORRECTED = "mce-corrected"
    MCE_UNCORRECTED = "mce-uncorrected"
    SXID_FATAL = "sxid-fatal"
    SXID_NONFATAL = "sxid-nonfatal"
    SXID_UNPARSED = "sxid-unparsed"  # an SXid line with no severity word: counted, reported
    SXID_DETAIL = "sxid-detail"  # a follow-up line; the collector keeps it only when orphaned
    PCIE_AER_FATAL = "pcie-aer-fatal"
    PCIE_AER_NONFATAL = "pcie-aer-nonfatal"
    PCIE_AER_CORRECTED = "pcie-aer-corrected"


# Substrings every pattern below contains: a line without any of them is skipped
# without a regex, and the collector finds candidate lines with str.find on the whole
# text. Long needles are found faster.
HINTS = ("I/O error", "nvme nvme", "read-only", "readonly", "XFS (", "soft lockup",
         "hard LOCKUP", "Uncorrected hardware", "achine check", "EDAC MC", "SXid (",
         "AER: ")

_PATTERNS: tuple[tuple[HostSignal, re.Pattern[str]], ...] = (
    # blk_update_request / blk_print_req_error: "I/O error, dev nvme0n1, sector 123 op 0x0"
    (HostSignal.NVME_IO_ERROR, re.compile(r"\bI/O error,? (?:on )?dev (?P<dev>nvme\d+n\d+)")),
    (HostSignal.NVME_IO_ERROR, re.compile(r"\bBuffer I/O error on dev (?P<dev>nvme\d+n\d+)")),
    (HostSignal.NVME_IO_ERROR, re.compile(
        r"\bnvme (?P<dev>nvme\d+): (?:I/O (?:tag )?\d+ .*QID \d+ timeout|"
        r"controller is down|Device not ready|Removing after probe failure)")),
    (HostSignal.READONLY_REMOUNT, re.compile(
        r"\bEXT[234]-fs (?:error )?\((?:device )?(?P<dev>[^)]+)\):.*[Rr]emounting filesystem "
        r"read-only")),
    (HostSignal.READONLY_REMOUNT, re.compile(
        r"\bXFS \((?P<dev>[^)]+)\): (?:.*Shutting down filesystem|"
        r"Filesystem has been shut down)")),
    (HostSignal.READONLY_REMOUNT, re.compile(
        r"\bBTRFS \w+ \(device (?P<dev>[^)]+)\): forced readonly")),
    (HostSignal.SOFT_LOCKUP, re.compile(r"\bBUG: soft lockup - CPU#(?P<dev>\d+) stuck for")),
    (HostSignal.HARD_LOCKUP, re.compile(r"\bWatchdog detected hard LOCKUP on cpu (?P<dev>\d+)")),
    (HostSignal.MCE_UNCORRECTED, re.compile(
        r"\b(?:mce: Uncorrected hardware memory error|Fatal [Mm]achine check|"
        r"Machine check: Processor context corrupt|"
        r"EDAC (?P<dev>MC\d+): \d+ UE )")),
    (HostSignal.MCE_CORRECTED, re.compile(
        r"\b(?:mce: \[Hardware Error\]: Machine check events logged|"
        r"EDAC (?P<dev>MC\d+): \d+ CE )")),
)


_AER = re.compile(
    r"\bAER: (?:Multiple )?(?P<cls>Corrected|Correctable|Uncorrect(?:ed|able) \((?P<sev>Non-Fatal|"
    r"Fatal)\)) error (?:message )?received(?::| from) (?P<dev>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:"
    r"[0-9a-fA-F]{2}\.[0-7])")


def _aer(message: str) -> tuple[HostSignal, str] | None:
    m = _AER.search(message)
    if m is None:
        return None  # a detail line of an event (severity, status, TLP header), or not AER
    signal = {"Fatal": HostSignal.PCIE_AER_FATAL, "Non-Fatal": HostSignal.PCIE_AER_NONFATAL,
              None: HostSignal.PCIE_AER_CORRECTED}[m["sev"]]
    return signal, m["dev"].lower()


# The device is "nvswitchN SXid NNNNN" so each switch and SXid number is told apart.
_SXID = re.compile(r"\bnvidia-(?P<sw>nvswitch\d+): SXid \((?:PCI:)?[0-9a-fA-F:.]+\): "
                   r"(?P<sxid>\d+), (?P<sev>Fatal|Non-fatal)\b")


# The driver's follow-up lines of one SXid event ("Severity 1 Engine instance 60 ...",
# "Data {...}"): details of the headline line before them, not events of their own.
_SXID_DETAIL = re.compile(r"\bSXid \((?:PCI:)?[0-9a-fA-F:.]+\): \d+, (?:Severity \d+ Engine "
                          r"instance|Data \{)")
_SXID_ANY = re.compile(r"\b(?:nvidia-(?P<sw>nvswitch\d+): )?SXid \((?:PCI:)?[0-9a-fA-F:.]+\): "
                       r"(?P<sxid>\d+)")


def _sxid(message: str) -> tuple[HostSignal, str] | None:
    m = _SXID.search(message)
    if m is None:
        # No severity word: a follow-up line of an event (kept by the collector only when
        # its headline is not in the read), or a format we don't know. Fatal or not can't
        # be told from it, so it is counted and reported, never dropped.
        any_m = _SXID_ANY.search(message)
        device = (f"{any_m['sw'] or 'nvswitch'} SXid {any_m['sxid']}" if any_m
                  else "nvswitch")
        detail = _SXID_DETAIL.search(message) is not None
        return (HostSignal.SXID_DETAIL if detail else HostSignal.SXID_UNPARSED), device
    signal = HostSignal.SXID_FATAL if m["sev"] == "Fatal" else HostSignal.SXID_NONFATAL
    return signal, f"{m['sw']} SXid {m['sxid']}"


def classify(message: str) -> tuple[HostSignal, str] | None:
    """The signal a kernel message reports and the device/CPU it names, or None."""
    if not any(h in message for h in HINTS):
        return None
    if "SXid (" in message:
        return _sxid(message)
    if "AER: " in message:
        return _aer(message)
    for signal, pattern in _PATTERNS:
        m = pattern.search(message)
        if m:
            return signal, m.groupdict().get("dev") or ""
    return None
