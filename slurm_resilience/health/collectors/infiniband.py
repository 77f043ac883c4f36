"""Read InfiniBand HCA ports from sysfs (``<root>/<hca>/ports/<n>/...``).

The real ``/sys/class/infiniband/<hca>`` entries are kernel symlinks into
``/sys/devices``, so they are followed; nothing under the root is writable by
users. Only the counters the check compares are read, to keep the prolog fast.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

_PORT_FILES = ("state", "phys_state", "rate", "link_layer")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read().strip()
    except FileNotFoundError:
        return None


def collect(root: str, counters: Iterable[str]) -> dict[str, Any]:
    """Snapshot: ``{"root", "hcas": {hca: {"hca_type", "fw_ver", "ports": {...}}}, "error"}``."""
    snap: dict[str, Any] = {"root": root, "hcas": {}, "error": None}
    names = sorted(counters)
    try:
        hcas = sorted(os.listdir(root))
    except FileNotFoundError:
        return snap  # no InfiniBand stack loaded: every expected HCA is then "missing"
    except OSError as exc:
        snap["error"] = f"couldn't list {root}: {exc.strerror}"
        return snap
    for hca in hcas:
        base = os.path.join(root, hca)
        entry: dict[str, Any] = {"hca_type": _read(os.path.join(base, "hca_type")),
                                 "fw_ver": _read(os.path.join(base, "fw_ver")), "ports": {}}
        try:
            ports = sorted(os.listdir(os.path.join(base, "ports")), key=lambda p: (len(p), p))
        except OSError as exc:
            entry["error"] = f"couldn't list {base}/ports: {exc.strerror}"
            snap["hcas"][hca] = entry
            continue
        for port in ports:
            pdir = os.path.join(base, "ports", port)
            pinfo: dict[str, Any] = {f: _read(os.path.join(pdir, f)) for f in _PORT_FILES}
            values: dict[str, int | None] = {}
            for name in names:
                text = _read(os.path.join(pdir, "counters", name))
                values[name] = int(text) if text is not None and text.isdigit() else None
            pinfo["counters"] = values
            entry["ports"][port] = pinfo
        snap["hcas"][hca] = entry
    return snap
