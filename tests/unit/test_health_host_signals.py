"""Host signals from the kernel log: NVMe I/O errors, read-only remounts, lockups, MCE."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.config.health import KernelLogCheckSection
from slurm_resilience.health.checks import host_signals
from slurm_resilience.health.collectors import xid as xid_collector
from slurm_resilience.health.collectors.host_signals import HostSignal
from slurm_resilience.health.collectors.xid import KernelLogSnapshot
from slurm_resilience.health.findings import Finding, Severity

LINES = (REAL_FIXTURES / "kernel-log" / "host-signals_handwritten.txt").read_text().splitlines()
NOW = dt.datetime(2026, 11, 23, 12, 0, 0).timestamp()
BOOT = NOW - 10000  # the fixture's stamps run to 8120 s


def snap_of(lines: list[str], boot: float = BOOT) -> KernelLogSnapshot:
    got = xid_collector.parse_lines(lines, "b1", boot, NOW)
    return KernelLogSnapshot("file", "", "b1", boot, tuple(got.events), tuple(got.host_events))


def judge(lines: list[str], cfg: KernelLogCheckSection | None = None,
          boot: float = BOOT) -> list[Finding]:
    return host_signals.check(snap_of(lines, boot), cfg or KernelLogCheckSection(), now=NOW)


def failed(findings: list[Finding]) -> set[str]:
    return {f.data["signal"] for f in findings if f.severity is Severity.FAIL}


def test_each_signal_is_recognised_once_per_event() -> None:
    """Each kernel line maps to its signal; an MCE's detail lines don't count again."""
    kinds = [e.signal for e in snap_of(LINES).host_events]
    assert kinds.count(HostSignal.NVME_IO_ERROR) == 3
    assert kinds.count(HostSignal.READONLY_REMOUNT) == 2
    assert kinds.count(HostSignal.SOFT_LOCKUP) == 1
    assert kinds.count(HostSignal.HARD_LOCKUP) == 1
    assert kinds.count(HostSignal.MCE_CORRECTED) == 2
    assert kinds.count(HostSignal.MCE_UNCORRECTED) == 1


def test_every_host_signal_fires_with_the_defaults() -> None:
    """NVMe I/O errors (per device), read-only remounts, a hard lockup and an uncorrected
    machine check fail; one soft lockup and two corrected MCEs are within the defaults."""
    findings = judge(LINES)
    assert failed(findings) == {"nvme-io-error", "readonly-remount", "hard-lockup",
                                "mce-uncorrected"}
    assert {f.subject for f in findings if f.severity is Severity.FAIL} == {
        "nvme0n1", "nvme1n1", "nvme1", "nvme1n1p1", "md0", "host"}
    messages = " ".join(f.message for f in findings if f.severity is Severity.FAIL)
    for words in ("nvme0n1 NVMe I/O error x1", "nvme1n1p1 filesystem read-only",
                  "md0 filesystem read-only", "host CPU hard lockup",
                  "host uncorrected machine check"):
        assert words in messages
    ok_signals = {f.data["signal"] for f in findings if f.severity is Severity.OK}
    assert ok_signals == {"soft-lockup", "mce-corrected"}


@pytest.mark.parametrize(("text", "signal", "cfg"), [
    ("watchdog: BUG: soft lockup", "soft-lockup", KernelLogCheckSection(max_soft_lockups=0)),
    ("EDAC MC0: 1 CE", "mce-corrected", KernelLogCheckSection(max_corrected_mce=0)),
    ("I/O error, dev nvme1n1", "nvme-io-error", KernelLogCheckSection()),
])
def test_thresholds_decide(text: str, signal: str, cfg: KernelLogCheckSection) -> None:
    """A signal within its threshold passes; above it fails."""
    line = next(ln for ln in LINES if text in ln)
    assert signal in failed(judge([line], cfg))
    loose = KernelLogCheckSection(max_soft_lockups=5, max_corrected_mce=5, max_nvme_io_errors=5)
    assert not failed(judge([line], loose))


@pytest.mark.parametrize("switch", ["nvme_io_errors", "readonly_remount", "soft_lockups",
                                    "hard_lockups", "mce"])
def test_each_kill_switch_silences_its_signal(switch: str) -> None:
    """Turning one signal off leaves the others judged."""
    cfg = KernelLogCheckSection(**{switch: False, "max_soft_lockups": 0,  # type: ignore[arg-type]
                                   "max_corrected_mce": 0})
    signals = set(failed(judge(LINES, cfg)))
    gone = {"nvme_io_errors": {"nvme-io-error"}, "readonly_remount": {"readonly-remount"},
            "soft_lockups": {"soft-lockup"}, "hard_lockups": {"hard-lockup"},
            "mce": {"mce-corrected", "mce-uncorrected"}}[switch]
    assert signals.isdisjoint(gone) and signals


def test_earlier_boot_and_old_events_are_history() -> None:
    """A lockup of an earlier boot or older than the window does not fail."""
    two_boots = (REAL_FIXTURES / "kernel-log" / "dmesg-two-boots_handwritten.txt").read_text()
    findings = judge(two_boots.splitlines(), KernelLogCheckSection(max_soft_lockups=0),
                     boot=NOW - 3600)
    assert not failed(findings)
    old = judge(LINES, KernelLogCheckSection(window_s=60))  # every stamp is > 30 min old
    assert not failed(old)


def test_unreadable_log_is_unknown() -> None:
    snap = KernelLogSnapshot("kmsg", "/dev/kmsg", "", 0.0, error="couldn't read")
    findings = host_signals.check(snap, KernelLogCheckSection(), now=NOW)
    assert [f.severity for f in findings] == [Severity.UNKNOWN]


def test_fake_kernel_log_lines_fire(tmp_path: Path) -> None:
    """The stand-in's host-signal records (what sandbox faults write) are read back."""
    from slurm_resilience.fakes import kmsg

    path = tmp_path / "kmsg"
    kmsg.append(str(path), kmsg.HOST_SIGNAL_LINES["readonly-remount"], priority=2)
    snap = xid_collector.collect("file", str(path), "", 1 << 20, 3600)
    findings = host_signals.check(snap, KernelLogCheckSection(), now=NOW)
    assert failed(findings) == {"readonly-remount"}
    assert [f.subject for f in findings] == ["nvme0n1p1"]


SXIDS = (REAL_FIXTURES / "kernel-log" / "nvswitch-sxid_handwritten.txt").read_text().splitlines()


def test_nvswitch_sxids_fatal_fails_for_the_boot_non_fatal_warns() -> None:
    """One event per SXid (the Severity/Data detail lines are not events); the fatal
    24007 on nvswitch3 fails, even past the window (it lasts until the reset); the two
    non-fatal ones warn; an earlier boot's fatal SXid is history; the kill switch."""
    events = snap_of(SXIDS).host_events
    assert [(e.signal, e.device) for e in events] == [
        (HostSignal.SXID_NONFATAL, "nvswitch2 SXid 12028"),
        (HostSignal.SXID_NONFATAL, "nvswitch0 SXid 20009"),
        (HostSignal.SXID_FATAL, "nvswitch3 SXid 24007")]
    findings = judge(SXIDS)
    assert [f.message for f in findings if f.severity is Severity.FAIL] == [
        "nvswitch3 SXid 24007 fatal x1 in the kernel log (tolerated 0): [ 7611.044871] "
        "nvidia-nvswitch3: "
        "SXid (PCI:0000:08:00.0): 24007, Fatal, Link 44 sourcetrack TCEN0 crumbstore ECC "
        "DBE Error (First)"]
    assert {f.subject for f in findings if f.severity is Severity.WARN} == {
        "nvswitch2 SXid 12028", "nvswitch0 SXid 20009"}
    assert failed(judge(SXIDS, KernelLogCheckSection(window_s=60))) == {"sxid-fatal"}
    assert not failed(judge(SXIDS, boot=NOW - 3600))  # stamps beyond uptime: earlier boot
    quiet = judge(SXIDS, KernelLogCheckSection(sxids=False))
    assert {f.severity for f in quiet} == {Severity.OK}
    kmsg = ["3,5521,7611044871,-;nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, "
            "Link 30 LTSSM Fault Up"]
    assert failed(judge(kmsg)) == {"sxid-fatal"}


def test_the_sandbox_sxid_line_fails_the_node(tmp_path: Path) -> None:
    """`sandbox inject node1 kernel-log:sxid` writes a fatal SXid the check reads back."""
    from slurm_resilience.fakes import kmsg

    path = tmp_path / "kmsg"
    kmsg.append(str(path), kmsg.HOST_SIGNAL_LINES["sxid"], priority=3)
    snap = xid_collector.collect("file", str(path), "", 1 << 20, 3600)
    findings = host_signals.check(snap, KernelLogCheckSection(), now=NOW)
    assert failed(findings) == {"sxid-fatal"}
    assert [f.subject for f in findings] == ["nvswitch3 SXid 24007"]


AER_REAL = (REAL_FIXTURES / "kernel-log" / "pcie-aer_kernel-commit-messages.txt").read_text()
AER_GPU = (REAL_FIXTURES / "kernel-log" / "pcie-aer-gpu_handwritten.txt").read_text()


def test_pcie_aer_errors_are_one_event_each_per_device() -> None:
    """Real AER bursts (Linux commit messages): one event per 'error received' line, for
    the device it names; the severity, status, UnsupReq/CmpltTO and TLP lines are its
    details. Kernel 6.x's 'error message received from' and 'Multiple' read the same."""
    events = snap_of(AER_REAL.splitlines()).host_events
    assert [(e.signal, e.device) for e in events] == [
        (HostSignal.PCIE_AER_NONFATAL, "0000:00:1d.0"),
        (HostSignal.PCIE_AER_NONFATAL, "0000:09:00.0")]
    events = snap_of(AER_GPU.splitlines()).host_events
    assert [(e.signal, e.device) for e in events] == [
        (HostSignal.PCIE_AER_FATAL, "0000:9b:00.0"),
        (HostSignal.PCIE_AER_NONFATAL, "0000:9b:00.0"),
        (HostSignal.PCIE_AER_CORRECTED, "0000:9b:00.0")]


def test_pcie_aer_uncorrectable_errors_fail_per_device_like_the_sysfs_counters() -> None:
    """Without any Xid, uncorrectable AER errors fail the node per device (the sysfs AER
    counters' tolerances: fatal 0, nonfatal 0, correctable 100); a correctable one is
    within; the kill switch and the tolerances decide."""
    findings = judge(AER_REAL.splitlines())
    assert failed(findings) == {"pcie-aer-nonfatal"}
    assert {f.subject for f in findings if f.severity is Severity.FAIL} == {
        "pcie 0000:00:1d.0", "pcie 0000:09:00.0"}
    gpu = judge(AER_GPU.splitlines())
    assert failed(gpu) == {"pcie-aer-fatal", "pcie-aer-nonfatal"}
    assert any(f.message.startswith("pcie 0000:9b:00.0 PCIe AER uncorrectable (fatal) error x1")
               for f in gpu)
    assert {f.data["signal"] for f in gpu if f.severity is Severity.OK} == {
        "pcie-aer-corrected"}
    assert not failed(judge(AER_GPU.splitlines(), KernelLogCheckSection(pcie_aer=False)))
    loose = KernelLogCheckSection(max_pcie_aer_errors={"fatal": 1, "nonfatal": 1})
    assert not failed(judge(AER_GPU.splitlines(), loose))


def test_the_sandbox_pcie_aer_line_fails_the_node(tmp_path: Path) -> None:
    """`sandbox inject node1 kernel-log:pcie-aer` writes an AER line the check reads back."""
    from slurm_resilience.fakes import kmsg

    path = tmp_path / "kmsg"
    kmsg.append(str(path), kmsg.HOST_SIGNAL_LINES["pcie-aer"], priority=3)
    snap = xid_collector.collect("file", str(path), "", 1 << 20, 3600)
    findings = host_signals.check(snap, KernelLogCheckSection(), now=NOW)
    assert failed(findings) == {"pcie-aer-nonfatal"}


def test_sxid_lines_without_a_severity_word_are_counted_never_dropped() -> None:
    """A real SXid Data line whose headline is not in the read (a dmesg --decode --level
    read, a ring buffer that lost it), and an SXid line in no known shape, are counted
    and reported (warn, unparsed); follow-up lines whose headline is in the read stay
    details of that event."""
    real = (REAL_FIXTURES / "xid" /
            "dmesg_h100-hgx_xid79-fallen-off-bus_nvswitch-sxid20034_gpud-readme.log")
    lines = real.read_text().splitlines()
    data = next(ln for ln in lines if "Data {" in ln)
    decoded = "kern  :err   : " + data.split("] ", 1)[1]
    strange = "[6781754.100000] nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, 0x10000000"
    events = snap_of([decoded, strange], boot=NOW - 6.79e6).host_events
    assert [e.signal for e in events] == [HostSignal.SXID_UNPARSED] * 2
    findings = judge([decoded, strange], boot=NOW - 6.79e6)
    warned = [f for f in findings if f.severity is Severity.WARN]
    assert [(f.subject, f.data["count"]) for f in warned] == [("nvswitch0 SXid 20034", 2)]
    assert "without a severity word" in warned[0].message
    whole = snap_of(lines, boot=NOW - 6.79e6).host_events
    assert HostSignal.SXID_UNPARSED not in {e.signal for e in whole}
    assert [e.signal for e in whole].count(HostSignal.SXID_FATAL) == 4
