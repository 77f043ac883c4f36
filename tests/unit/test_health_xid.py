"""Xid parsing against real kernel-log captures, and the Xid check's window, dedup and list."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from conftest import REAL_FIXTURES

from slurm_resilience.config.health import XidCheckSection
from slurm_resilience.fakes import kmsg
from slurm_resilience.health import xid_catalog, xid_repairs
from slurm_resilience.health.checks import xid as xid_check
from slurm_resilience.health.collectors import xid as xid_collector
from slurm_resilience.health.collectors.xid import KernelLogSnapshot, XidEvent
from slurm_resilience.health.findings import Severity

XID_DIR = REAL_FIXTURES / "xid"
NOW = time.time()


def parse(lines: list[str]) -> list[XidEvent]:
    return xid_collector.parse_lines(lines, "boot1", NOW - 3600, NOW).events


def test_every_collected_xid_line_parses() -> None:
    """Each line of the collected real Xid lines with an ``NVRM: Xid`` parses to its code."""
    lines = (XID_DIR / "xid-lines_collected.txt").read_text().splitlines()
    xid_lines = [ln for ln in lines if "NVRM: Xid" in ln]
    events = parse(lines)
    assert len(events) == len(xid_lines) > 50
    for line, ev in zip(xid_lines, events, strict=True):
        assert f"): {ev.xid}, " in line
        assert f"pci:{ev.pci}" in line.lower()
    assert {ev.xid for ev in events} >= {13, 31, 32, 43, 45, 48, 63, 64, 74, 79, 94, 109,
                                            119, 120, 144, 145, 149, 154}
    # SXid (NVSwitch) lines and the Xid-less "fallen off the bus" are not GPU Xids.
    assert not parse([ln for ln in lines if "SXid" in ln or "NVRM: The NVIDIA GPU" in ln])


def test_timestamps_of_every_format() -> None:
    """dmesg -T, ISO, --decode ISO, syslog and kmsg timestamps become epoch times."""
    lines = (XID_DIR / "xid-lines_collected.txt").read_text().splitlines()
    events = {ev.xid: ev for ev in parse(lines)}
    ctime = parse([ln for ln in lines if ln.startswith("[Sun Feb 23 16:24:18 2025]")])[0]
    assert time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ctime.time)) == \
        "2025-02-23 16:24:18"
    iso = parse([ln for ln in lines if ln.startswith("2024-11-15T12:02:03,470068+00:00")])[0]
    assert iso.time is not None and abs(iso.time - 1731672123.470068) < 1e-3
    decoded = parse([ln for ln in lines if ln.startswith("kern  :warn  : 2025-01-21T02:21:33")])
    assert decoded[0].time is not None
    assert abs(decoded[0].time - 1737426093.498559) < 1e-3
    syslog = parse([ln for ln in lines if ln.startswith("Dec  2 11:38:47 worker4")])[0]
    assert time.localtime(syslog.time).tm_mon == 12
    bare = parse([ln for ln in lines if ln.startswith("NVRM: Xid (PCI:0000:01:00): 144")])[0]
    assert bare.time is None
    assert events[79].pci == "0000:91:00"


def test_pid_and_process_name_are_split_from_the_text() -> None:
    """``pid=..., name=...,`` prefixes are parsed out of the message."""
    ev = parse(["[Sun Feb 23 16:24:18 2025] NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, "
                "name=nvidia-smi, Timeout after 6s of waiting for RPC response"])[0]
    assert (ev.pid, ev.process, ev.text[:7]) == (2024380, "nvidia-smi", "Timeout")


def test_real_dmesg_logs_parse() -> None:
    """The four real dmesg captures yield their documented Xids."""
    found = {}
    for path in sorted(XID_DIR.glob("dmesg*.log")):
        found[path.name] = {ev.xid for ev in parse(path.read_text().splitlines())}
    assert found["dmesg-ctime_h100-node_xid119-gsp-rpc-timeout_gpud.log"] == {119}
    assert found["dmesg-iso_node_xid48-dbe_xid63-row-remap_xid94-contained_gpud.log"] == \
        {48, 63, 94}
    assert found["dmesg-decode-iso_node_xid13-sm-exception_xid43-burst_gpud.log"] == {13, 43}
    assert found["dmesg_h100-hgx_xid79-fallen-off-bus_nvswitch-sxid20034_gpud-readme.log"] == \
        {79}


def test_kmsg_records_from_the_fake_parse_back(tmp_path: Path) -> None:
    """A record the fake writes is read back with its sequence number and time."""
    path = tmp_path / "kmsg"
    kmsg.append_xid(str(path), "00000000:9A:00.0", 79, when=NOW - 5)
    kmsg.append_xid(str(path), "00000000:9A:00.0", 13, when=NOW - 1)
    boot = tmp_path / "boot_id"
    boot.write_text("b-1\n")
    snap = xid_collector.collect("file", str(path), str(boot), 1 << 20, 3600)
    assert [(e.key, e.xid, e.pci) for e in snap.events] == [
        ("b-1:1", 79, "0000:9a:00"), ("b-1:2", 13, "0000:9a:00")]
    assert snap.events[0].time is not None and abs(snap.events[0].time - (NOW - 5)) < 0.01
    assert path.read_text().startswith("4,1,")


def test_missing_file_source_is_empty_and_unreadable_is_an_error(tmp_path: Path) -> None:
    """A file source not yet written has no events; an unreadable kmsg is an error."""
    assert xid_collector.collect("file", str(tmp_path / "none"), "", 4096, 60).events == ()
    assert xid_collector.collect("kmsg", str(tmp_path / "none"), "", 4096, 60).error


def snap_of(*events: tuple[str, int, str, float | None], boot: str = "b1") -> KernelLogSnapshot:
    return KernelLogSnapshot("file", "", boot, NOW - 86400 * 10, events=tuple(
        XidEvent(e[0] or f"{boot}:{i}", e[1], "0000:9a:00", None, "", e[2], e[3])
        for i, e in enumerate(events)))


def run(snap: KernelLogSnapshot, state: xid_check.XidState | None = None,
        cfg: XidCheckSection | None = None, now: float = NOW, job_start: float | None = None,
        **kw: Any) -> tuple[list[Any], xid_check.XidState]:
    r = xid_check.check(snap, cfg or XidCheckSection(), state or xid_check.XidState(), now=now,
                        gpu_by_pci={"00000000:9A:00.0": 3}, job_start=job_start, **kw)
    return r.findings, r.state


def test_fatal_xid_fails_with_gpu_meaning_and_time() -> None:
    """Xid 79 on the GPU at 9a:00 fails as ``gpu3 XID 79 (GPU fell off the bus) HH:MM:SS``."""
    findings, _ = run(snap_of(("", 79, "GPU has fallen off the bus.", NOW - 60)))
    clock = time.strftime("%H:%M:%S", time.localtime(NOW - 60))
    assert [(f.severity, f.message) for f in findings] == [
        (Severity.FAIL, f"gpu3 XID 79 (GPU fell off the bus) {clock}, reboot required")]
    assert findings[0].data["gpu"] == 3 and findings[0].data["pci"] == "0000:9a:00"


def test_non_fatal_xid_passes() -> None:
    """An application Xid (13) is listed but does not fail."""
    findings, _ = run(snap_of(("", 13, "Graphics SM Warp Exception", NOW - 60)))
    assert [f.severity for f in findings] == [Severity.OK]


def test_each_event_counts_once_across_runs() -> None:
    """Reading the same log twice keeps one event; a second event increments the count."""
    s1 = snap_of(("", 48, "DBE", NOW - 60))
    _, state = run(s1)
    findings, state = run(s1, state)
    assert findings[0].data["count"] == 1
    s2 = snap_of(("", 48, "DBE", NOW - 60), ("", 48, "DBE", NOW - 30))
    findings, state = run(s2, state)
    assert findings[0].data["count"] == 2 and " x2 " in findings[0].message


def test_events_leave_the_window_and_a_new_boot_forgets() -> None:
    """A fatal Xid older than window_s passes; so does one from an earlier boot."""
    old = snap_of(("", 79, "GPU has fallen off the bus.", NOW - 7200))
    findings, _ = run(old, cfg=XidCheckSection(window_s=3600, fatal_until="window"))
    assert [f.severity for f in findings] == [Severity.OK]
    _, state = run(snap_of(("", 79, "x", NOW - 60)))
    findings, _ = run(snap_of(boot="b2"), state)
    assert all(f.severity is Severity.OK for f in findings)


def test_site_overrides_of_the_fatal_list() -> None:
    """extra_fatal adds a code, not_fatal removes one, fatal replaces the list."""
    s = snap_of(("", 63, "Row Remapper", NOW - 60))
    assert run(s)[0][0].severity is Severity.OK
    assert run(s, cfg=XidCheckSection(extra_fatal=(63,)))[0][0].severity is Severity.FAIL
    s79 = snap_of(("", 79, "x", NOW - 60))
    assert run(s79, cfg=XidCheckSection(not_fatal=(79,)))[0][0].severity is Severity.OK
    assert run(s79, cfg=XidCheckSection(fatal=(13,)))[0][0].severity is Severity.OK


def test_message_decides_nvlink_and_recovery_xids() -> None:
    """NVLink Xids marked Nonfatal and Xid 154 back to None do not fail; Fatal ones do."""
    fatal = xid_catalog.DEFAULT_FATAL
    assert xid_catalog.is_fatal(149, "NETIR_LINK_EVT  Fatal   XC0 i0 Link 01", fatal)
    assert not xid_catalog.is_fatal(145, "RLW_SRC_TRACK Nonfatal XC1 i0 Link 03", fatal)
    assert not xid_catalog.is_fatal(144, "SAW_MVB Nonfatal XC0 i0 Link 0", fatal)
    assert xid_catalog.is_fatal(154, "GPU recovery action changed from 0x0 (None) to 0x4 "
                                     "(Drain and Reset)", fatal)
    assert not xid_catalog.is_fatal(154, "changed from 0x4 (Drain and Reset) to 0x0 (None)",
                                    fatal)
    assert {63, 68, 92}.isdisjoint(fatal)


def test_epilog_reports_non_fatal_xids_raised_during_the_job() -> None:
    """In the epilog a non-fatal Xid newer than the job start is a warning."""
    s = snap_of(("", 43, "Ch 00000008", NOW - 10))
    findings, _ = run(s, job_start=NOW - 100)
    assert findings[0].severity is Severity.WARN
    assert findings[0].message.endswith("during the job")
    findings, _ = run(s, job_start=NOW - 5)
    assert findings[0].severity is Severity.OK


def test_unreadable_log_is_could_not_check() -> None:
    """A collector error becomes an unknown finding."""
    findings, _ = run(KernelLogSnapshot("file", "", "b1", 0.0,
                                        error="couldn't read the kernel log"))
    assert findings[0].severity is Severity.UNKNOWN


def test_journalctl_short_iso_precise_lines_parse() -> None:
    """``journalctl -k -o short-iso-precise`` lines (both offset spellings) give the time."""
    for stamp in ("2024-11-15T12:02:03.470068+0000", "2024-11-15T12:02:03.470068+00:00"):
        ev = parse([f"{stamp} gpu-node-1 kernel: NVRM: Xid (PCI:0000:19:00): 48, pid='<unknown>', "
                    "name=<unknown>, An uncorrectable double bit error (DBE) has been detected"])
        assert ev[0].xid == 48 and ev[0].time is not None
        assert abs(ev[0].time - 1731672123.470068) < 1e-3


def test_an_xid_storm_keeps_the_state_bounded() -> None:
    """Thousands of events keep only the newest MAX_EVENTS in the state."""
    storm = snap_of(*[("", 13, "Graphics SM Warp Exception", NOW - 3000 + i * 0.5)
                      for i in range(xid_check.MAX_EVENTS + 500)])
    findings, state = run(storm)
    assert len(state.events) == xid_check.MAX_EVENTS
    assert findings[0].data["count"] == xid_check.MAX_EVENTS


BARE_79 = ("NVRM: Xid (PCI:0000:9a:00): 79, pid='<unknown>', name=<unknown>, "
           "GPU has fallen off the bus.")


def read_log(lines: list[str], boot_id: str, now: float) -> KernelLogSnapshot:
    """What the collector would return for a file holding ``lines``."""
    got = xid_collector.parse_lines(lines, boot_id, now - 3600, now)
    return KernelLogSnapshot("file", "", boot_id, now - 3600, tuple(got.events),
                             tuple(got.host_events), got.unparsed,
                             tuple(got.unparsed_sample), got.undated)


def test_one_old_undated_line_never_drains_twice() -> None:
    """The drain loop from one old line: a bare fatal Xid line is dated when first seen.
    After the window ages it out, reading the same log again does not raise it again,
    not even after a reboot (a new boot id)."""
    cfg = XidCheckSection(window_s=3600, fatal_until="window")
    findings, state = run(read_log([BARE_79], "b1", NOW), cfg=cfg)
    assert [f.severity for f in findings] == [Severity.FAIL]
    later = NOW + 3601
    findings, state = run(read_log([BARE_79], "b1", later), state, cfg=cfg, now=later)
    assert all(f.severity is Severity.OK for f in findings)
    findings, state = run(read_log([BARE_79], "b1", later + 60), state, cfg=cfg, now=later + 60)
    assert all(f.severity is Severity.OK for f in findings)
    findings, _ = run(read_log([BARE_79], "b2", later + 120), state, cfg=cfg, now=later + 120)
    assert all(f.severity is Severity.OK for f in findings)


def test_an_undated_line_still_failing_at_a_reboot_is_not_raised_again_after_it() -> None:
    """A reboot is repair; the undated line read before it, read again after it (a log file
    spans boots), is the earlier boot's and does not fail the new one."""
    findings, state = run(read_log([BARE_79], "b1", NOW))
    assert [f.severity for f in findings] == [Severity.FAIL]
    findings, _ = run(read_log([BARE_79], "b2", NOW + 600), state, now=NOW + 600)
    assert all(f.severity is Severity.OK for f in findings)


def test_fatal_xid_lasts_past_the_window_until_repaired() -> None:
    """A GPU that needs a reset stays failed after the 24 h window; a repair recorded
    after the event (e.g. a clean diagnostic) ends it, and reading the log again does
    not bring it back."""
    snap = snap_of(("", 48, "DBE", NOW - 60))
    _, state = run(snap)
    two_days = NOW + 2 * 86400
    findings, state = run(snap, state, now=two_days)
    assert [f.severity for f in findings] == [Severity.FAIL]
    assert findings[0].data["clears_on"]
    repair = xid_repairs.Repair("00000000:9A:00.0", two_days, "dcgm diag level 3 passed")
    findings, state = run(snap, state, now=two_days + 1, repairs=[repair])
    assert all(f.severity is Severity.OK for f in findings)
    assert any("ended: dcgm diag level 3 passed" in f.message for f in findings)
    findings, state = run(snap, state, now=two_days + 2)
    assert all(f.severity is Severity.OK for f in findings)
    # A new Xid after the repair fails again.
    findings, _ = run(snap_of(("", 48, "DBE", NOW - 60), ("", 48, "DBE", two_days + 3)),
                      state, now=two_days + 4)
    assert [f.severity for f in findings] == [Severity.FAIL]


def test_repair_hook_on_the_state() -> None:
    """record_repair (the API a diagnostic can call on the state) ends earlier fatal Xids
    that a reset ends (48); never one that needs a new boot (79)."""
    _, state = run(snap_of(("", 48, "x", NOW - 60)))
    xid_check.record_repair(state, xid_repairs.Repair("0000:9a:00", NOW, "operator reset"))
    findings, _ = run(snap_of(("", 48, "x", NOW - 60)), state, now=NOW + 1)
    assert all(f.severity is Severity.OK for f in findings)
    _, state = run(snap_of(("", 79, "x", NOW - 60)))
    xid_check.record_repair(state, xid_repairs.Repair("0000:9a:00", NOW, "operator reset"))
    findings, _ = run(snap_of(("", 79, "x", NOW - 60)), state, now=NOW + 1)
    assert [f.message.rsplit(", ", 1)[1] for f in findings] == ["reboot required"]


def test_gpu_back_on_the_bus_is_a_reset() -> None:
    """Xid 119 (RESET_GPU): NVML saw the GPU lost; when it answers again, the GPU was
    reset, which ends it. Xid 79 (RESTART_BM) stays failed: only a new boot ends it."""
    for xid, ends in ((119, True), (79, False)):
        snap = snap_of(("", xid, "GPU has fallen off the bus.", NOW - 60))
        findings, state = run(snap, gpus_ok={"00000000:9A:00.0": False})
        assert [f.severity for f in findings] == [Severity.FAIL]
        findings, state = run(snap, state, now=NOW + 60, gpus_ok={"00000000:9A:00.0": False})
        assert [f.severity for f in findings] == [Severity.FAIL]
        findings, state = run(snap, state, now=NOW + 120, gpus_ok={"00000000:9A:00.0": True})
        if ends:
            assert all(f.severity is Severity.OK for f in findings)
            assert any("back on the bus" in f.message for f in findings)
        else:
            assert [(f.severity, f.message.endswith("reboot required")) for f in findings] \
                == [(Severity.FAIL, True)]
            findings, _ = run(snap_of(boot="b2"), state, now=NOW + 180)  # a new boot
            assert all(f.severity is Severity.OK for f in findings)


def test_a_gpu_never_seen_lost_is_not_taken_for_reset() -> None:
    """Xid 48 on a GPU NVML always saw healthy: no reset evidence, still failed."""
    snap = snap_of(("", 48, "DBE", NOW - 60))
    findings, state = run(snap, gpus_ok={"00000000:9A:00.0": True})
    findings, _ = run(snap, state, now=NOW + 60, gpus_ok={"00000000:9A:00.0": True})
    assert [f.severity for f in findings] == [Severity.FAIL]


def test_unparsed_xid_lines_reach_a_finding() -> None:
    """Lines that name an Xid in no known format are a warning with count and sample."""
    snap = read_log(["[ 3310.402881] NVRM: Xid (PCI:0000:9b"], "b1", NOW)
    findings, _ = run(snap)
    assert [(f.severity, f.subject) for f in findings] == [(Severity.WARN, "kernel-log")]
    assert findings[0].data["unparsed"] == 1 and "0000:9b" in findings[0].message


def test_repair_ledger_round_trip(tmp_path: Path) -> None:
    """record() appends, load() reads back with the PCI address normalised; garbled lines
    are counted, not fatal."""
    xid_repairs.record(str(tmp_path), xid_repairs.Repair("00000000:9A:00.0", NOW, "diag"))
    with open(tmp_path / xid_repairs.LEDGER, "a") as fh:
        fh.write("{not json\n")
    repairs, garbled = xid_repairs.load(str(tmp_path))
    assert repairs == [xid_repairs.Repair("0000:9a:00", NOW, "diag", "reset")] and garbled == 1
    assert xid_repairs.load(str(tmp_path / "none")) == ([], 0)


def test_catalogue_fatal_set_and_sources() -> None:
    """145, 46, 155, 156, 158 and 109 (NVIDIA: RESET_GPU) drain; 121 (C2C, NVIDIA: IGNORE)
    does not; every entry names its source."""
    fatal = xid_catalog.DEFAULT_FATAL
    assert {145, 46, 155, 156, 158, 109} <= fatal and 121 not in fatal
    assert all("https://docs.nvidia.com/" in e.source for e in xid_catalog.ENTRIES.values())
    assert xid_catalog.action(121) is xid_catalog.Action.IGNORE
    assert xid_catalog.action(46) is xid_catalog.Action.RESET_GPU


def test_an_xid_storm_never_pushes_out_a_fatal_event() -> None:
    """An old unrepaired fatal Xid survives a storm of newer non-fatal ones."""
    storm = snap_of(("", 48, "DBE", NOW - 3500),
                    *[("", 13, "Graphics SM Warp Exception", NOW - 3000 + i * 0.5)
                      for i in range(xid_check.MAX_EVENTS + 10)])
    findings, state = run(storm)
    assert len(state.events) == xid_check.MAX_EVENTS
    assert [f.data["xid"] for f in findings if f.severity is Severity.FAIL] == [48]
