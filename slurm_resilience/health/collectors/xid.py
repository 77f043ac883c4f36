"""Read NVIDIA Xid events from the kernel log.

Sources: ``/dev/kmsg`` (records ``prio,seq,usec,flags;message``), ``journalctl -k``,
or a file holding either kmsg records or dmesg/syslog text lines (``[  365.97]``,
``dmesg -T``, ``--time-format iso``, ``--decode``, syslog ``Mon DD hh:mm:ss host
kernel:``, or bare ``NVRM:``). Each event gets a stable key (boot id + kmsg
sequence number, or a hash of the line) so the check can count it once.
"""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import os
import re
import time
from typing import Any

from slurm_resilience.proc import CommandError, Runner

XID_RE = re.compile(
    r"NVRM: Xid \(PCI:(?P<dom>[0-9a-fA-F]{4}):(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})"
    r"(?:\.\d)?\): (?P<xid>\d+), (?P<rest>.*)$"
)
_PID_NAME = re.compile(r"^pid=(?P<pid>'<unknown>'|\d+), (?:name=(?P<name>.*?), )?(?P<text>.*)$")
_KMSG = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<usec>\d+),[^;]*;(?P<msg>.*)$")
_ISO = re.compile(
    r"(?P<ts>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:[,.](?P<frac>\d+))?(?P<tz>[+-]\d{2}:?\d{2}|Z)?"
)
_CTIME = re.compile(r"^\[(?P<ts>[A-Z][a-z]{2} [A-Z][a-z]{2} +\d+ \d{2}:\d{2}:\d{2} \d{4})\]")
_MONO = re.compile(r"\[\s*(?P<sec>\d+\.\d+)\]")
_SYSLOG = re.compile(r"^(?P<ts>[A-Z][a-z]{2} +\d+ \d{2}:\d{2}:\d{2}) \S+ kernel:")


def boot_time() -> float:
    """Wall-clock time of boot, to turn kmsg's microseconds-since-boot into a time."""
    return time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)


def read_boot_id(path: str) -> str:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _line_time(line: str, boot: float, now: float) -> float | None:
    """When a text line was logged, from whichever timestamp format it carries."""
    m = _CTIME.match(line)
    if m:
        return dt.datetime.strptime(m["ts"], "%a %b %d %H:%M:%S %Y").timestamp()
    m = _SYSLOG.match(line)
    if m:
        year = dt.datetime.fromtimestamp(now).year
        stamp = dt.datetime.strptime(f"{year} {m['ts']}", "%Y %b %d %H:%M:%S").timestamp()
        if stamp > now + 86400:  # syslog has no year: December's line read in January
            stamp = dt.datetime.strptime(f"{year - 1} {m['ts']}", "%Y %b %d %H:%M:%S").timestamp()
        return stamp
    head = line.split("NVRM:", 1)[0]
    m = _ISO.search(head)
    if m:
        tz = m["tz"] or ""
        text = m["ts"] + ("." + m["frac"][:6] if m["frac"] else "")
        if tz == "Z":
            tz = "+00:00"
        elif tz and ":" not in tz:
            tz = tz[:3] + ":" + tz[3:]
        parsed = dt.datetime.fromisoformat(text + tz)
        return parsed.timestamp()
    m = _MONO.search(head)
    if m:
        return boot + float(m["sec"])
    return None


def parse_event(message: str) -> dict[str, Any] | None:
    """The Xid fields of one kernel message, or None when it is not an Xid line."""
    m = XID_RE.search(message)
    if not m:
        return None
    rest = m["rest"].strip()
    pid: int | None = None
    name = ""
    pm = _PID_NAME.match(rest)
    if pm:
        pid = int(pm["pid"]) if pm["pid"].isdigit() else None
        name = pm["name"] or ""
        rest = pm["text"]
    return {
        "pci": f"{m['dom']}:{m['bus']}:{m['dev']}".lower(),
        "xid": int(m["xid"]),
        "pid": pid,
        "process": name,
        "text": rest,
    }


def parse_lines(lines: list[str], boot_id: str, boot: float, now: float) -> list[dict[str, Any]]:
    """Xid events from kernel-log lines of any supported format."""
    events: list[dict[str, Any]] = []
    for raw in lines:
        line = raw.rstrip("\n")
        if "Xid" not in line:
            continue
        km = _KMSG.match(line)
        if km:
            event = parse_event(km["msg"])
            if event is None:
                continue
            event["time"] = boot + int(km["usec"]) / 1e6
            event["key"] = f"{boot_id}:{km['seq']}"
        else:
            event = parse_event(line)
            if event is None:
                continue
            event["time"] = _line_time(line, boot, now)
            digest = hashlib.sha1(f"{boot_id}\n{line}".encode(), usedforsecurity=False)
            event["key"] = f"{boot_id}:h{digest.hexdigest()[:16]}"
        events.append(event)
    return events


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
    result = Runner().run(
        ["journalctl", "-k", "-b", "-q", "--no-pager", "-o", "short-iso-precise",
         f"--since=-{int(window_s)}s"], timeout=timeout)
    return result.stdout.splitlines()


def collect(source: str, path: str, boot_id_file: str, max_read_bytes: int, window_s: int,
            timeout: float = 5.0) -> dict[str, Any]:
    """Snapshot: ``{"source", "boot_id", "events": [...], "error"}``."""
    boot_id = read_boot_id(boot_id_file)
    boot = boot_time()
    now = time.time()
    snap: dict[str, Any] = {"source": source, "path": path, "boot_id": boot_id, "events": [],
                            "error": None}
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
            return snap
        snap["error"] = f"couldn't read the kernel log {path}: not found"
        return snap
    except (OSError, CommandError) as exc:
        snap["error"] = f"couldn't read the kernel log ({source} {path}): {exc}"
        return snap
    snap["events"] = parse_lines(lines, boot_id, boot, now)
    return snap
