"""Kernel-log parsing: every Xid format, localised and host-less stamps, boots, stable keys."""

from __future__ import annotations

import datetime as dt
import time

from conftest import REAL_FIXTURES

from slurm_resilience.health.collectors import xid as xid_collector
from slurm_resilience.health.collectors.host_signals import HostSignal
from slurm_resilience.health.collectors.kernlog_time import BootOf
from slurm_resilience.health.collectors.xid import KernelLogSnapshot, ParsedLog

KLOG = REAL_FIXTURES / "kernel-log"
# 2026-11-23 12:00 local time; the boot an hour before.
NOW = dt.datetime(2026, 11, 23, 12, 0, 0).timestamp()
BOOT = NOW - 3600


def parse(lines: list[str], boot_id: str = "b1", boot: float = BOOT,
          now: float = NOW) -> ParsedLog:
    return xid_collector.parse_lines(lines, boot_id, boot, now)


def formats() -> list[str]:
    text = (KLOG / "xid-formats_handwritten.txt").read_text(encoding="utf-8")
    return text.splitlines()


def line_with(text: str) -> str:
    return next(ln for ln in formats() if text in ln)


def test_older_driver_format_without_pci_prefix_parses() -> None:
    """``NVRM: Xid (0000:03:00): 13, ...`` (drivers before ``PCI:``) is parsed, not dropped."""
    got = parse([line_with("Xid (0000:03:00)"), line_with("Xid (0000:06:00)"),
                 line_with("Xid (0000:8a:00)")])
    assert [(e.xid, e.pci) for e in got.events] == [
        (13, "0000:03:00"), (31, "0000:06:00"), (8, "0000:8a:00")]
    assert got.events[1].text.startswith("Ch 00000010") and got.unparsed == 0
    assert got.events[2].text == "Channel 00000020"


def test_mig_instance_format_parses() -> None:
    """With MIG the driver adds the GPU instance: ``(PCI:0000:1b:00 GPU-I:05)``."""
    ev = parse([line_with("GPU-I:05")]).events[0]
    assert (ev.xid, ev.pci, ev.pid, ev.process) == (94, "0000:1b:00", 7194, "python3")


def test_journal_short_formats_localised_months_and_missing_hostname() -> None:
    """German and French month names, short-precise, short-iso, short-unix, syslog without
    a hostname and a German ``dmesg -T`` all give the time they state."""
    def when(text: str) -> float | None:
        return parse([line_with(text)]).events[0].time

    def local(*args: int) -> float:
        return dt.datetime(*args).timestamp()  # type: ignore[arg-type]

    assert when("Dez 03 14:07:52") == local(2025, 12, 3, 14, 7, 52)  # December: last year
    assert when("févr. 11 09:30:01") == local(2026, 2, 11, 9, 30, 1)
    assert when("Mar 02 17:45:10.381204") == local(2026, 3, 2, 17, 45, 10) + 0.381204
    assert when("2026-03-02T17:45:11+0100") == dt.datetime(
        2026, 3, 2, 16, 45, 11, tzinfo=dt.timezone.utc).timestamp()
    assert when("1772469912.117003") == 1772469912.117003
    assert when("Mar  2 17:45:13 kernel:") == local(2026, 3, 2, 17, 45, 13)
    assert when("[Mo Mär  2 17:45:14 2026]") == local(2026, 3, 2, 17, 45, 14)


def test_journal_short_full_format() -> None:
    """``-o short-full`` (weekday, date, zone) in local time, or UTC when it says so."""
    msg = "host kernel: NVRM: Xid (PCI:0000:5d:00): 79, GPU has fallen off the bus."
    local = parse([f"Mon 2026-03-02 17:45:10 CET {msg}"]).events[0]
    utc = parse([f"Mon 2026-03-02 17:45:10.25 UTC {msg}"]).events[0]
    assert local.time == dt.datetime(2026, 3, 2, 17, 45, 10).timestamp()
    assert utc.time == dt.datetime(2026, 3, 2, 17, 45, 10, 250000,
                                   tzinfo=dt.timezone.utc).timestamp()


def test_unknown_month_gives_no_time_but_a_stable_key() -> None:
    """A month name we can't read (Polish ``lis``) leaves the time unknown, never "now";
    the key is the same every time the line is read, whatever the boot id."""
    line = line_with("lis 23 10:01:02")
    first = parse([line]).events[0]
    again = parse(["unrelated line", line], boot_id="b2", now=NOW + 86400 * 3).events[0]
    assert first.time is None and first.key == again.key and first.key.startswith("u:")
    assert first.xid == 74


def test_identical_undated_lines_are_separate_events() -> None:
    """Two identical bare lines are two events, each with its own stable key."""
    line = line_with("NVRM: Xid (PCI:0000:3b:00): 74")
    got = parse([line, line])
    assert len({e.key for e in got.events}) == 2 and got.undated == 2


def test_lines_naming_an_xid_in_no_known_format_are_counted() -> None:
    """A cut line and an unknown wording are counted as unparsed with a sample, not dropped."""
    got = parse(formats())
    assert got.unparsed == 2
    assert any("0000:9b" in s for s in got.unparsed_sample)
    assert len(got.events) == len([ln for ln in formats() if "NVRM: Xid (" in ln]) - 1
    # NVSwitch SXid lines are not GPU Xids and not unparsed either.
    sxid = [ln for ln in (REAL_FIXTURES / "xid" / "xid-lines_collected.txt").read_text()
            .splitlines() if "SXid" in ln]
    assert sxid and parse(sxid).unparsed == 0


def test_every_collected_real_line_is_parsed_or_counted() -> None:
    """Over the real captures, each line naming an Xid is an event or counted unparsed."""
    xid_dir = REAL_FIXTURES / "xid"
    for path in [*sorted(xid_dir.glob("*.log")), xid_dir / "xid-lines_collected.txt"]:
        lines = path.read_text(encoding="utf-8").splitlines()
        named = [ln for ln in lines if xid_collector.NAMES_XID.search(ln)]
        got = parse(lines)
        assert len(got.events) + got.unparsed == len(named), path.name


def test_seconds_from_an_earlier_boot_are_never_dated_in_the_future() -> None:
    """Lines before the last ``Linux version`` marker belong to an earlier boot: no time,
    not this boot; after it, seconds count from this boot."""
    lines = (KLOG / "dmesg-two-boots_handwritten.txt").read_text().splitlines()
    got = parse(lines)
    old, new = got.events
    assert (old.xid, old.boot, old.time) == (79, BootOf.EARLIER, None)
    assert new.xid == 48 and new.boot is BootOf.CURRENT
    assert new.time is not None and abs(new.time - (BOOT + 1200.503311)) < 1e-6
    assert all(e.time is None or e.time <= NOW for e in got.events)
    lockup = got.host_events[0]
    assert lockup.signal is HostSignal.SOFT_LOCKUP and lockup.boot is BootOf.EARLIER


def test_a_file_from_a_longer_earlier_boot_is_not_this_boot() -> None:
    """Seconds beyond the current uptime can't be this boot: earlier boot, no time."""
    ev = parse(["[ 90000.5] NVRM: Xid (PCI:0000:5d:00): 79, GPU has fallen off the bus."]
               ).events[0]
    assert ev.boot is BootOf.EARLIER and ev.time is None


def test_calendar_time_before_this_boot_is_an_earlier_boot() -> None:
    """A syslog line logged before this boot started is history of an earlier boot."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime(BOOT - 7200))
    ev = parse([f"{stamp} n1 kernel: NVRM: Xid (PCI:0000:5d:00): 79, GPU has fallen off the "
                "bus."]).events[0]
    assert ev.boot is BootOf.EARLIER and ev.time == BOOT - 7200


def test_journal_boot_separator_ends_the_earlier_boot() -> None:
    """``journalctl -k`` over several boots prints ``-- Boot <id> --``: an undated line
    before the last separator is an earlier boot's, one after it this boot's."""
    msg = "host kernel: NVRM: Xid (PCI:0000:5d:00): 79, GPU has fallen off the bus."
    got = parse(["-- Boot 6d3c6b0a0e4c4b8e9e2a4f0b1c2d3e4f --", f"lis 22 10:00:00 {msg}",
                 "-- Boot 0a9b8c7d6e5f40312233445566778899 --", f"lis 23 10:00:00 {msg}"])
    assert [(e.boot, e.time) for e in got.events] == [(BootOf.EARLIER, None),
                                                      (BootOf.CURRENT, None)]


def test_kmsg_sequence_restart_starts_a_new_boot() -> None:
    """In a saved kmsg file, a sequence number that goes back starts the running boot."""
    msg = "NVRM: Xid (PCI:0000:5d:00): 79, GPU has fallen off the bus."
    got = parse([f"4,900,86000000000,-;{msg}", f"4,3,5000000,-;{msg}"])
    assert [e.boot for e in got.events] == [BootOf.EARLIER, BootOf.CURRENT]
    assert got.events[1].key == "b1:3" and got.events[1].time == BOOT + 5.0


def test_snapshot_crosses_the_pipe_as_json() -> None:
    """The typed snapshot survives to_json → from_json unchanged."""
    lines = formats() + (KLOG / "host-signals_handwritten.txt").read_text().splitlines()
    got = parse(lines)
    snap = KernelLogSnapshot("file", "/x", "b1", BOOT, tuple(got.events), tuple(got.host_events),
                             got.unparsed, tuple(got.unparsed_sample), got.undated)
    assert KernelLogSnapshot.from_json(snap.to_json()) == snap
