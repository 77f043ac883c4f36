"""Read NVIDIA Xid events (and the host signals beside them) from the kernel log.

Sources: ``/dev/kmsg`` (records ``prio,seq,usec,flags;message``), ``journalctl -k``,
or a file holding either kmsg records or dmesg/syslog/journal text lines (see
:mod:`kernlog_time` for every time format read). Every line that names an Xid is
either parsed or counted as unparsed, with a sample kept for the finding: none is
dropped silently. Each event gets a stable key so the check counts it once:

* kmsg records: boot id + sequence number;
* lines with a calendar time or boot-relative seconds: boot id + a hash of the line;
* lines without a usable time: a hash of the normalised line and its occurrence among
  identical lines, without the boot id, since we can't tell which boot logged it. The
  check remembers these keys past its window, so re-reading the same old line never
  raises it again.
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from slurm_resilience.health.collectors import host_signals
from slurm_resilience.health.collectors.host_signals import HostSignal
from slurm_resilience.health.collectors.kernlog_time import (
    BootOf,
    Stamp,
    boot_segments,
    is_boot_marker,
    read_stamp,
)

# Current drivers print ``(PCI:0000:01:00)``, with MIG ``(PCI:0000:01:00 GPU-I:05)``;
# older ones ``(0000:01:00)``.
XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<dom>[0-9a-fA-F]{4}):(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})"
    r"(?:\.\d)?(?: [^)]*)?\): (?P<xid>\d+)(?:,(?: (?P<rest>.*))?)?$"
)
# Any line that names an Xid (not an NVSwitch SXid): it must parse or be counted.
NAMES_XID = re.compile(r"(?<![A-Za-z])Xid\b")
_PID_NAME = re.compile(r"^pid=(?P<pid>'<unknown>'|\d+), (?:name=(?P<name>.*?), )?(?P<text>.*)$")
_KMSG = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<usec>\d+),[^;]*;(?P<msg>.*)$")
# Stamps this far before the computed boot time still count as this boot (NTP steps).
_BOOT_SLACK_S = 120.0
SAMPLE_LINES = 3


@dataclass(frozen=True)
class XidEvent:
    """One Xid line. ``time`` is None when the line carries no usable time."""

    key: str
    xid: int
    pci: str
    pid: int | None
    process: str
    text: str
    time: float | None
    boot: BootOf = BootOf.CURRENT


@dataclass(frozen=True)
class HostEvent:
    """One host-signal line (NVMe I/O error, read-only remount, lockup, MCE)."""

    key: str
    signal: HostSignal
    device: str
    text: str
    time: float | None
    boot: BootOf = BootOf.CURRENT


@dataclass
class ParsedLog:
    """What the lines of one read hold."""

    events: list[XidEvent] = field(default_factory=list)
    host_events: list[HostEvent] = field(default_factory=list)
    unparsed: int = 0  # lines that name an Xid but match no known driver format
    unparsed_sample: list[str] = field(default_factory=list)
    undated: int = 0  # Xid lines without a usable time (identified by their text)


@dataclass(frozen=True)
class KernelLogSnapshot:
    """The collector's result; crosses the collector child's pipe as JSON."""

    source: str
    path: str
    boot_id: str
    boot_time: float
    events: tuple[XidEvent, ...] = ()
    host_events: tuple[HostEvent, ...] = ()
    unparsed: int = 0
    unparsed_sample: tuple[str, ...] = ()
    undated: int = 0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["events"] = [{**asdict(e), "boot": e.boot.value} for e in self.events]
        out["host_events"] = [{**asdict(e), "boot": e.boot.value, "signal": e.signal.value}
                              for e in self.host_events]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KernelLogSnapshot:
        return cls(
            source=str(data.get("source", "")), path=str(data.get("path", "")),
            boot_id=str(data.get("boot_id", "")), boot_time=float(data.get("boot_time", 0.0)),
            events=tuple(XidEvent(**{**e, "boot": BootOf(e["boot"])})
                         for e in data.get("events", [])),
            host_events=tuple(HostEvent(**{**e, "boot": BootOf(e["boot"]),
                                           "signal": HostSignal(e["signal"])})
                              for e in data.get("host_events", [])),
            unparsed=int(data.get("unparsed", 0)),
            unparsed_sample=tuple(data.get("unparsed_sample", ())),
            undated=int(data.get("undated", 0)), error=data.get("error"))


def boot_time() -> float:
    """Wall-clock time of boot, to turn kmsg's microseconds-since-boot into a time."""
    return time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)


def read_boot_id(path: str) -> str:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class XidFields:
    pci: str
    xid: int
    pid: int | None
    process: str
    text: str


def parse_message(message: str) -> XidFields | None:
    """The Xid fields of one kernel message, or None when it is not an Xid line."""
    m = XID_RE.search(message)
    if not m:
        return None
    rest = (m["rest"] or "").strip()
    pid: int | None = None
    name = ""
    pm = _PID_NAME.match(rest)
    if pm:
        pid = int(pm["pid"]) if pm["pid"].isdigit() else None
        name = pm["name"] or ""
        rest = pm["text"]
    return XidFields(f"{m['dom']}:{m['bus']}:{m['dev']}".lower(), int(m["xid"]), pid, name,
                     rest)


def _digest(text: str) -> str:
    import hashlib  # only for undated lines: loading OpenSSL costs the prolog ~8 ms

    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]


def _normalised(line: str) -> str:
    return " ".join(line.split())


@dataclass(frozen=True)
class _Placed:
    """One line with its message, time and boot worked out."""

    message: str
    time: float | None
    boot: BootOf
    key: str


def _place_lines(lines: list[str], boot_id: str, boot: float, now: float,
                 wanted: list[bool]) -> list[_Placed | None]:
    """Time, boot and key of each wanted line; the others are only used for boot markers."""
    kmsg = [_KMSG.match(ln) for ln in lines]
    stamps: list[Stamp | None] = []
    for ln, km, want in zip(lines, kmsg, wanted, strict=True):
        if km:
            stamps.append(Stamp(None, int(km["usec"]) / 1e6, True))
        elif want or "[" in ln[:40]:
            anchor = ln.find("NVRM:")
            stamps.append(read_stamp(ln, now, anchor))
        else:
            stamps.append(None)
    markers = [is_boot_marker(ln) for ln in lines]
    # kmsg sequence numbers restart at each boot, too.
    last_seq = -1
    for i, km in enumerate(kmsg):
        if km:
            seq = int(km["seq"])
            if seq < last_seq:
                markers[i] = True
            last_seq = seq
    segments = boot_segments(stamps, markers)
    last = segments[-1] if segments else 0
    uptime = now - boot
    current_ok = all(s is None or s.mono is None or s.mono <= uptime + 1.0
                     for s, seg in zip(stamps, segments, strict=True) if seg == last)
    seen_untimed: dict[str, int] = {}
    out: list[_Placed | None] = []
    for ln, km, stamp, seg, want in zip(lines, kmsg, stamps, segments, wanted, strict=True):
        if not want:
            out.append(None)
            continue
        in_current = seg == last and current_ok
        message = km["msg"] if km else ln
        when: float | None = None
        if stamp is not None and stamp.wall is not None:
            when = stamp.wall
            this_boot = when >= boot - _BOOT_SLACK_S
        elif stamp is not None and stamp.mono is not None and in_current:
            when = boot + stamp.mono
            this_boot = True
        else:
            this_boot = in_current
        if when is not None and when > now + 300:
            when = None  # never a time in the future (a clock set wrong when it was logged)
        bootof = BootOf.CURRENT if this_boot else BootOf.EARLIER
        if km and this_boot:
            key = f"{boot_id}:{km['seq']}"
        elif when is not None:
            key = f"{boot_id if this_boot else 'earlier'}:h{_digest(ln)}"
        else:
            norm = _normalised(ln)
            n = seen_untimed.get(norm, 0)
            seen_untimed[norm] = n + 1
            key = f"u:{_digest(norm)}#{n}"
        out.append(_Placed(message, when, bootof, key))
    return out


# Substrings that make a line worth a closer look: found with str.find over the whole
# text, so the thousands of ordinary lines of a kernel log cost next to nothing.
_NEEDLES = ("Xid", *host_signals.HINTS, "Linux version", "-- Boot", "-- Reboot")


def _candidates(lines: list[str]) -> list[int]:
    """Indexes of the lines holding any needle, in order (C-speed scans, no per-line loop)."""
    text = "\n".join(lines)
    hits: list[int] = []
    for needle in _NEEDLES:
        pos = text.find(needle)
        while pos >= 0:
            hits.append(pos)
            end = text.find("\n", pos)
            pos = text.find(needle, end + 1) if end >= 0 else -1
    hits.sort()
    found: list[int] = []
    line = prev = 0
    for pos in hits:
        line += text.count("\n", prev, pos)
        prev = pos
        if not found or found[-1] != line:
            found.append(line)
    return found


def parse_lines(lines: list[str], boot_id: str, boot: float, now: float) -> ParsedLog:
    """Xid events, host signals and unparsed Xid lines from kernel-log lines of any format.

    Only lines holding a needle are examined; boots are told apart on those (plus the
    last line) by markers and by stamps going back.
    """
    result = ParsedLog()
    picked: list[str] = []
    wanted: list[bool] = []
    signals: list[tuple[HostSignal, str] | None] = []
    for i in _candidates(lines):
        ln = lines[i].rstrip("\r\n")
        sig = host_signals.classify(ln)
        want = sig is not None or bool(NAMES_XID.search(ln))
        if want or is_boot_marker(ln):
            picked.append(ln)
            wanted.append(want)
            signals.append(sig)
    if lines and (not picked or picked[-1] != lines[-1].rstrip("\r\n")):
        # The newest line tells whether the last boot in the file is still running.
        picked.append(lines[-1].rstrip("\r\n"))
        wanted.append(False)
        signals.append(None)
    for ln, placed, sig in zip(picked, _place_lines(picked, boot_id, boot, now, wanted), signals,
                               strict=True):
        if placed is None:
            continue
        if sig is not None:
            result.host_events.append(HostEvent(placed.key, sig[0], sig[1],
                                                placed.message[:300], placed.time, placed.boot))
            continue
        fields = parse_message(placed.message)
        if fields is None:
            result.unparsed += 1
            if len(result.unparsed_sample) < SAMPLE_LINES:
                result.unparsed_sample.append(ln[:200])
            continue
        if placed.time is None:
            result.undated += 1
        result.events.append(XidEvent(placed.key, fields.xid, fields.pci, fields.pid,
                                      fields.process, fields.text, placed.time, placed.boot))
    result.host_events = _orphaned_sxid_details(result.host_events)
    return result


def _orphaned_sxid_details(events: list[HostEvent]) -> list[HostEvent]:
    """SXid follow-up lines describe the headline before them: dropped where that headline
    (same switch, same SXid) is in the read, else kept as lines without a severity word
    (a read that starts after the headline, a ``dmesg --level`` that filtered it out)."""
    headlines = {e.device for e in events
                 if e.signal in (HostSignal.SXID_FATAL, HostSignal.SXID_NONFATAL)}
    return [replace(e, signal=HostSignal.SXID_UNPARSED)
            if e.signal is HostSignal.SXID_DETAIL else e
            for e in events
            if e.signal is not HostSignal.SXID_DETAIL or e.device not in headlines]


def _read_kmsg_device(path: str, max_bytes: int) -> list[str]:
    """Every record still in the kernel ring buffer; reading stops when it is drained."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    lines: list[str] = []
    total = 0
    try:
        while total < max_bytes:
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while reading: go on
                    continue
                raise
            if not chunk:
                break
            total += len(chunk)
            lines.append(chunk.decode("utf-8", "replace").split("\n", 1)[0])
    finally:
        os.close(fd)
    return lines


def _read_file_tail(path: str, max_bytes: int) -> list[str]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            os.lseek(fd, size - max_bytes, os.SEEK_SET)
        data = b""
        while len(data) < max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes - len(data)))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    text = data.decode("utf-8", "replace")
    lines = text.split("\n")
    if size > max_bytes and lines:
        lines = lines[1:]  # the first line was cut by the seek
    return lines


def _read_journal(window_s: int, timeout: float) -> list[str]:
    # Imported here: subprocess and friends stay off the prolog's path for file/kmsg sources.
    from slurm_resilience.proc import CommandError, Runner

    try:
        result = Runner().run(
            ["journalctl", "-k", "-b", "-q", "--no-pager", "-o", "short-iso-precise",
             f"--since=-{int(window_s)}s"], timeout=timeout)
    except CommandError as exc:
        raise OSError(str(exc)) from None
    return result.stdout.splitlines()


def collect(source: str, path: str, boot_id_file: str, max_read_bytes: int, window_s: int,
            timeout: float = 5.0) -> KernelLogSnapshot:
    """Read the kernel log once; Xids and host signals both come from this read."""
    boot_id = read_boot_id(boot_id_file)
    boot = boot_time()
    now = time.time()
    base = KernelLogSnapshot(source=source, path=path, boot_id=boot_id, boot_time=boot)
    try:
        if source == "journal":
            lines = _read_journal(window_s, timeout)
        elif source == "kmsg" and path.startswith("/dev/"):
            lines = _read_kmsg_device(path, max_read_bytes)
        else:
            lines = _read_file_tail(path, max_read_bytes)
    except FileNotFoundError:
        if source == "file":
            # A file source that does not exist yet has simply logged nothing.
            return base
        return replace(base, error=f"couldn't read the kernel log {path}: not found")
    except OSError as exc:
        return replace(base, error=f"couldn't read the kernel log ({source} {path}): {exc}")
    parsed = parse_lines(lines, boot_id, boot, now)
    return replace(base, events=tuple(parsed.events), host_events=tuple(parsed.host_events),
                   unparsed=parsed.unparsed, unparsed_sample=tuple(parsed.unparsed_sample),
                   undated=parsed.undated)
