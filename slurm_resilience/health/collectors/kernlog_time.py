"""When a kernel-log line was logged, and which boot it belongs to.

Kernel-log text comes in many shapes; each one is read from the start of the line:

* ``dmesg``: ``[  365.974528] msg``, seconds since *that* boot;
* ``dmesg -T``: ``[Sun Feb 23 16:24:18 2025] msg`` (weekday and month may be localised);
* ``dmesg --time-format iso``, journalctl ``-o short-iso``/``short-iso-precise``, rsyslog
  RFC 3339: ``2025-02-23T16:24:18,470068+00:00 ...``;
* journalctl ``-o short``/``short-precise`` and classic syslog: ``Feb 23 16:24:18[.123] host
  kernel: ...``; the hostname may be missing and the month may be localised (``Dez``,
  ``févr.``);
* journalctl ``-o short-unix``: ``1740327858.470068 host kernel: ...``;
* journalctl ``-o short-full``: ``Sun 2025-02-23 16:24:18 CET host kernel: ...`` (local time,
  or UTC when the zone says so);
* ``dmesg --decode`` puts ``kern  :warn  : `` in front of any of these.

Seconds since boot only mean something next to the boot they count from. A file may
hold several boots: a stamp that goes back (a new ``[    0.000000]``), a ``Linux version``
line, or journalctl's ``-- Boot <id> --`` starts a new one. Only the last one can be the
running boot, and only when none of its stamps lies beyond the current uptime; every
other line belongs to an earlier boot, whose start we don't know, so its seconds give
no time at all (never one in the future).
"""

from __future__ import annotations

import datetime as dt
import enum
import re
from dataclasses import dataclass

# Abbreviated month names as glibc prints ``%b`` in the locales sites use most, lower-case
# and without the trailing dot: English, German, French, Spanish, Italian, Portuguese, Dutch.
_MONTHS: dict[str, int] = {}
for _number, _names in enumerate((
        "jan ene gen janv", "feb fev févr fevr", "mar mär märz mars mrt", "apr abr avr avril",
        "may mai mei mag", "jun juin giu", "jul juil lug", "aug ago août aou",
        "sep set sept", "oct okt ott out", "nov", "dec dez déc dic"), start=1):
    for _name in _names.split():
        _MONTHS[_name] = _number

_DECODE = re.compile(r"^[a-z]+\s*:\s*[a-z]+\s*: ")
_CTIME = re.compile(
    r"^\[(?P<wd>[^\W\d_]+\.?) +(?P<mon>[^\W\d_]+\.?) +(?P<day>\d{1,2}) "
    r"(?P<hms>\d{2}:\d{2}:\d{2}) (?P<year>\d{4})\]")
_ISO = re.compile(
    r"^(?P<ts>\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2})(?:[,.](?P<frac>\d+))?"
    r"(?P<tz>[+-]\d{2}:?\d{2}|Z)?(?=\s)")
_SHORT = re.compile(
    r"^(?P<mon>[^\W\d_]{3,5}\.?) +(?P<day>\d{1,2}),? (?P<hms>\d{2}:\d{2}:\d{2})"
    r"(?:\.(?P<frac>\d+))?(?=\s)")
_FULL = re.compile(
    r"^[^\W\d_]{2,4}\.? (?P<date>\d{4}-\d{2}-\d{2}) (?P<hms>\d{2}:\d{2}:\d{2})"
    r"(?:\.(?P<frac>\d+))? (?P<zone>[A-Za-z][\w+-]*) ")
_UNIX = re.compile(r"^(?P<sec>\d{9,11})\.(?P<frac>\d+) ")
_MONO = re.compile(r"\[\s*(?P<sec>\d+\.\d+)\]")
_BOOT_MARKER = re.compile(r"(?:^-- (?:Boot [0-9a-f]+|Reboot) --$|\bLinux version \d)")


class BootOf(enum.Enum):
    """Which boot a line was logged in."""

    CURRENT = "current"
    EARLIER = "earlier"


@dataclass(frozen=True)
class Stamp:
    """What the start of one line says about when it was logged."""

    wall: float | None  # seconds since the epoch, when the line carries a calendar time
    mono: float | None  # seconds since its boot, when it carries a ``[seconds]`` stamp
    readable: bool  # False: the line starts with a time we could not read (unknown month)


def _month(name: str) -> int | None:
    return _MONTHS.get(name.lower().rstrip("."))


def _local(year: int, month: int, day: int, hms: str, frac: str | None) -> float | None:
    try:
        h, m, s = (int(x) for x in hms.split(":"))
        stamp = dt.datetime(year, month, day, h, m, s).timestamp()
    except ValueError:
        return None
    return stamp + (float("0." + frac) if frac else 0.0)


def _short_year(month: int, day: int, hms: str, frac: str | None, now: float) -> float | None:
    """Syslog has no year: the one that does not put the line in the future."""
    year = dt.datetime.fromtimestamp(now).year
    stamp = _local(year, month, day, hms, frac)
    if stamp is not None and stamp > now + 86400:  # December's line read in January
        stamp = _local(year - 1, month, day, hms, frac)
    return stamp


def _iso_utc(year: int, month: int, day: int, hms: str, frac: str | None) -> float | None:
    try:
        h, m, s = (int(x) for x in hms.split(":"))
        stamp = dt.datetime(year, month, day, h, m, s, tzinfo=dt.timezone.utc).timestamp()
    except ValueError:
        return None
    return stamp + (float("0." + frac) if frac else 0.0)


def _iso(m: re.Match[str]) -> float | None:
    tz = m["tz"] or ""
    if tz == "Z":
        tz = "+00:00"
    elif tz and ":" not in tz:
        tz = tz[:3] + ":" + tz[3:]
    text = m["ts"].replace(" ", "T") + ("." + m["frac"][:6] if m["frac"] else "")
    try:
        return dt.datetime.fromisoformat(text + tz).timestamp()
    except ValueError:
        return None


def read_stamp(line: str, now: float, anchor: int = -1) -> Stamp:
    """The calendar time and/or boot-relative seconds at the start of ``line``.

    ``anchor`` (where the message proper starts, e.g. ``NVRM:``) bounds the search for a
    ``[seconds]`` stamp, so a bracketed number inside the message is never taken for one.
    """
    head = _DECODE.sub("", line, count=1)
    wall: float | None = None
    readable = True
    m = _CTIME.match(head)
    if m:
        month = _month(m["mon"])
        wall = (_local(int(m["year"]), month, int(m["day"]), m["hms"], None)
                if month else None)
        readable = wall is not None
    elif (m := _ISO.match(head)) is not None:
        wall = _iso(m)
        readable = wall is not None
    elif (m := _SHORT.match(head)) is not None:
        month = _month(m["mon"])
        wall = _short_year(month, int(m["day"]), m["hms"], m["frac"], now) if month else None
        readable = wall is not None
    elif (m := _FULL.match(head)) is not None:
        y, mo, d = (int(x) for x in m["date"].split("-"))
        wall = _local(y, mo, d, m["hms"], m["frac"])
        if wall is not None and m["zone"] in ("UTC", "GMT"):
            wall = _iso_utc(y, mo, d, m["hms"], m["frac"])
        readable = wall is not None
    elif (m := _UNIX.match(head)) is not None:
        wall = float(f"{m['sec']}.{m['frac']}")
    limit = anchor if anchor >= 0 else min(len(line), 160)
    mm = _MONO.search(line, 0, limit)
    mono = float(mm["sec"]) if mm else None
    return Stamp(wall, mono, readable)


def is_boot_marker(line: str) -> bool:
    return bool(_BOOT_MARKER.search(line))


def boot_segments(stamps: list[Stamp | None], markers: list[bool]) -> list[int]:
    """The boot index of each line (0 = the oldest boot in the file).

    A new boot starts at a marker line or where the seconds-since-boot go back by more
    than a second (printk from different CPUs may be out of order by microseconds).
    """
    seg = 0
    last_mono: float | None = None
    lines_in_seg = 0
    out: list[int] = []
    for stamp, marker in zip(stamps, markers, strict=True):
        mono = stamp.mono if stamp else None
        if marker:
            if lines_in_seg:
                seg += 1
                lines_in_seg = 0
            last_mono = None
        elif mono is not None and last_mono is not None and mono < last_mono - 1.0:
            seg += 1
            lines_in_seg = 0
        if mono is not None:
            last_mono = mono
        if not marker:
            lines_in_seg += 1
        out.append(seg)
    return out
