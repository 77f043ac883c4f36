"""Read InfiniBand HCA ports from sysfs (``<root>/<hca>/ports/<n>/...``).

The real ``/sys/class/infiniband/<hca>`` entries are kernel symlinks into
``/sys/devices``, so they are followed; nothing under the root is writable by
users. Only the counters the check compares are read, to keep the prolog fast.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class IbPort:
    state: str | None = None  # "4: ACTIVE"
    phys_state: str | None = None  # "5: LinkUp"
    rate: str | None = None  # "400 Gb/sec (4X NDR)"
    link_layer: str | None = None  # "InfiniBand" or "Ethernet"
    counters: dict[str, int | None] = field(default_factory=dict)


@dataclass
class IbHca:
    hca_type: str | None = None
    fw_ver: str | None = None
    ports: dict[str, IbPort] = field(default_factory=dict)
    error: str | None = None


@dataclass
class IbSnapshot:
    root: str
    hcas: dict[str, IbHca] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> IbSnapshot:
        hcas = {name: IbHca(h.get("hca_type"), h.get("fw_ver"),
                            {p: IbPort(**v) for p, v in h.get("ports", {}).items()},
                            h.get("error"))
                for name, h in d.get("hcas", {}).items()}
        return cls(str(d.get("root", "")), hcas, d.get("error"))


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read().strip()
    except FileNotFoundError:
        return None


def collect(root: str, counters: Iterable[str]) -> IbSnapshot:
    """Every HCA under ``root`` with its ports' state, rate and the named counters."""
    snap = IbSnapshot(root)
    names = sorted(counters)
    try:
        hcas = sorted(os.listdir(root))
    except FileNotFoundError:
        return snap  # no InfiniBand stack loaded: every expected HCA is then "missing"
    except OSError as exc:
        snap.error = f"couldn't list {root}: {exc.strerror}"
        return snap
    for hca in hcas:
        base = os.path.join(root, hca)
        entry = IbHca(_read(os.path.join(base, "hca_type")), _read(os.path.join(base, "fw_ver")))
        snap.hcas[hca] = entry
        try:
            ports = sorted(os.listdir(os.path.join(base, "ports")), key=lambda p: (len(p), p))
        except OSError as exc:
            entry.error = f"couldn't list {base}/ports: {exc.strerror}"
            continue
        for port in ports:
            pdir = os.path.join(base, "ports", port)
            pinfo = IbPort(state=_read(os.path.join(pdir, "state")),
                           phys_state=_read(os.path.join(pdir, "phys_state")),
                           rate=_read(os.path.join(pdir, "rate")),
                           link_layer=_read(os.path.join(pdir, "link_layer")))
            for name in names:
                text = _read(os.path.join(pdir, "counters", name))
                pinfo.counters[name] = int(text) if text is not None and text.isdigit() \
                    else None
            entry.ports[port] = pinfo
    return snap


def collect_json(root: str, counters: Iterable[str]) -> dict[str, Any]:
    """:func:`collect` for the collector child, whose answer travels as JSON."""
    return collect(root, counters).to_json()
