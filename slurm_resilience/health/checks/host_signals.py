"""Host signals from the kernel log: NVMe I/O errors, read-only remounts, lockups, MCE,
PCIe AER errors, NVSwitch SXids.

A pure function of the kernel-log snapshot the Xid collector already took: events
of the current boot within ``window_s`` are counted per signal (and per device for
NVMe) and set against the thresholds in ``health.kernel_log``. Events of an earlier
boot are history: a reboot cleared the lockup, remounted the disk. A fatal SXid
counts for the whole current boot, whatever ``window_s`` says: the NVSwitch stays
unusable until it is reset, which on HGX baseboards means a reboot. PCIe AER errors
are counted per device and class against ``max_pcie_aer_errors`` (the tolerances of
the sysfs AER counters, ``gpu.max_pcie_aer_delta``), so a burst of uncorrectable
errors fails the node even where no Xid follows. An SXid line without a severity word
is reported (warn) as unparsed, never dropped.
"""

from __future__ import annotations

from collections import Counter

from slurm_resilience.config.health import KernelLogCheckSection
from slurm_resilience.health.checks.spec import CheckSpec, Judged, NoState, RunFacts
from slurm_resilience.health.collectors.host_signals import HostSignal
from slurm_resilience.health.collectors.kernlog_time import BootOf
from slurm_resilience.health.collectors.xid import HostEvent, KernelLogSnapshot
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok, unknown, warn

NAME = "kernel"

_WHAT = {
    HostSignal.NVME_IO_ERROR: "NVMe I/O error",
    HostSignal.READONLY_REMOUNT: "filesystem read-only",
    HostSignal.SOFT_LOCKUP: "CPU soft lockup",
    HostSignal.HARD_LOCKUP: "CPU hard lockup",
    HostSignal.MCE_CORRECTED: "corrected machine check",
    HostSignal.MCE_UNCORRECTED: "uncorrected machine check",
    HostSignal.SXID_FATAL: "fatal",
    HostSignal.SXID_NONFATAL: "non-fatal",
    HostSignal.SXID_UNPARSED: "line(s) without a severity word (unparsed: fatal or not "
                              "can't be told)",
    HostSignal.PCIE_AER_FATAL: "PCIe AER uncorrectable (fatal) error",
    HostSignal.PCIE_AER_NONFATAL: "PCIe AER uncorrectable (non-fatal) error",
    HostSignal.PCIE_AER_CORRECTED: "PCIe AER corrected error",
}
_AER_CLASSES = {"fatal": HostSignal.PCIE_AER_FATAL, "nonfatal": HostSignal.PCIE_AER_NONFATAL,
                "correctable": HostSignal.PCIE_AER_CORRECTED}
# Signals that only ever warn (a non-fatal SXid: the switch corrected or contained it).
_WARN_ONLY = (HostSignal.SXID_NONFATAL, HostSignal.SXID_UNPARSED)
# Signals judged over the whole current boot (they last until the device is reset).
_WHOLE_BOOT = (HostSignal.SXID_FATAL,)


def _limits(cfg: KernelLogCheckSection) -> dict[HostSignal, int]:
    """Events tolerated per signal; a signal switched off is absent."""
    limits: dict[HostSignal, int] = {}
    if cfg.nvme_io_errors:
        limits[HostSignal.NVME_IO_ERROR] = cfg.max_nvme_io_errors
    if cfg.readonly_remount:
        limits[HostSignal.READONLY_REMOUNT] = 0
    if cfg.soft_lockups:
        limits[HostSignal.SOFT_LOCKUP] = cfg.max_soft_lockups
    if cfg.hard_lockups:
        limits[HostSignal.HARD_LOCKUP] = 0
    if cfg.mce:
        limits[HostSignal.MCE_UNCORRECTED] = 0
        limits[HostSignal.MCE_CORRECTED] = cfg.max_corrected_mce
    if cfg.sxids:
        limits[HostSignal.SXID_FATAL] = cfg.max_fatal_sxids
        limits[HostSignal.SXID_NONFATAL] = 0
        limits[HostSignal.SXID_UNPARSED] = 0
    if cfg.pcie_aer:
        for name, limit in cfg.max_pcie_aer_errors.items():
            if name in _AER_CLASSES:  # the config refuses other names when it loads
                limits[_AER_CLASSES[name]] = limit
    return limits


def _subject(signal: HostSignal, device: str) -> str:
    if signal is HostSignal.NVME_IO_ERROR or signal is HostSignal.READONLY_REMOUNT:
        return device or "disk"
    if signal in (HostSignal.SXID_FATAL, HostSignal.SXID_NONFATAL, HostSignal.SXID_UNPARSED):
        return device or "nvswitch"
    if signal in _AER_CLASSES.values():
        return f"pcie {device}" if device else "pcie"
    return "host"


def check(snap: KernelLogSnapshot, cfg: KernelLogCheckSection, *, now: float) -> list[Finding]:
    if snap.error:
        return [unknown(NAME, "kernel-log", f"host signals: {snap.error}")]
    limits = _limits(cfg)
    horizon = now - cfg.window_s
    recent: list[HostEvent] = [
        e for e in snap.host_events
        if e.boot is BootOf.CURRENT and e.signal in limits
        and (e.time is None or e.time >= horizon or e.signal in _WHOLE_BOOT)]
    # NVMe errors and read-only remounts are judged per device, the rest per host.
    counts: Counter[tuple[HostSignal, str]] = Counter(
        (e.signal, _subject(e.signal, e.device)) for e in recent)
    findings: list[Finding] = []
    for (signal, subject), count in sorted(counts.items(), key=lambda kv: kv[0][0].value):
        last = [e for e in recent if e.signal is signal and _subject(signal, e.device) == subject]
        sample = last[-1].text[:160]
        limit = limits[signal]
        message = (f"{subject} {_WHAT[signal]} x{count} in the kernel log "
                   f"(tolerated {limit}): {sample}")[:240]
        data = {"signal": signal.value, "count": count, "limit": limit, "sample": sample}
        if count > limit and signal in _WARN_ONLY:
            findings.append(warn(NAME, subject, message, **data))
        elif count > limit:
            findings.append(fail(NAME, subject, message, **data))
        else:
            findings.append(ok(NAME, subject, message, **data))
    if not findings:
        findings.append(ok(NAME, "kernel-log", "no NVMe I/O error, read-only remount, lockup, "
                                               "machine check, PCIe AER error or SXid in "
                                               "this boot"))
    return findings


def _judge(snap: KernelLogSnapshot, state: NoState, facts: RunFacts) -> Judged[NoState]:
    return CheckResult(check(snap, facts.cfg.health.kernel_log, now=facts.now), state), []


# Reads the kernel log the Xid collector took: the log is read once for both.
SPEC = CheckSpec(NAME, lambda h: h.kernel_log, KernelLogSnapshot.from_json, _judge, NoState,
                 rank=3, collector="xid")
