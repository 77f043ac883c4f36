"""Xid checks: fatal Xids within the window fail; each event counts once.

The state keeps every event seen in the window, keyed by boot id and kmsg
sequence number (or line hash), so re-reading the kernel log never counts an
event twice and an event survives the ring buffer wrapping. Events of an
earlier boot are dropped: a reboot resets the GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from slurm_resilience.config.health import XidCheckSection
from slurm_resilience.health import xid_catalog
from slurm_resilience.health.findings import CheckResult, Finding, fail, ok, unknown, warn

NAME = "xid"
MAX_EVENTS = 2000


def pci_key(bus_id: str) -> str:
    """``00000000:9B:00.0`` (NVML) or ``0000:9b:00`` (kernel log) → ``0000:9b:00``."""
    text = bus_id.lower().split(".", 1)[0]
    parts = text.split(":")
    if len(parts) != 3:
        return text
    dom, bus, dev = parts
    return f"{int(dom, 16):04x}:{bus}:{dev}"


def _clock(t: float, now: float) -> str:
    fmt = "%H:%M:%S" if now - t < 86400 else "%m-%d %H:%M:%S"
    return time.strftime(fmt, time.localtime(t))


def check(snap: dict[str, Any], cfg: XidCheckSection, state: dict[str, Any], *,
          now: float, gpu_by_pci: Mapping[str, int] | None = None,
          job_start: float | None = None) -> CheckResult:
    """``job_start`` (epilog): non-fatal Xids raised since then are reported as warnings."""
    if snap.get("error"):
        return CheckResult([unknown(NAME, "kernel-log", f"xid: {snap['error']}")], state)
    boot_id = snap.get("boot_id", "")
    events: dict[str, dict[str, Any]] = {}
    if state.get("boot_id") == boot_id:
        events = {k: dict(v) for k, v in state.get("events", {}).items()}
    for ev in snap.get("events", []):
        if ev["key"] not in events:
            events[ev["key"]] = {"xid": ev["xid"], "pci": ev["pci"], "text": ev["text"][:200],
                                 "time": ev["time"] if ev["time"] is not None else now}
    horizon = now - cfg.window_s
    events = {k: v for k, v in events.items() if v["time"] >= horizon}
    if len(events) > MAX_EVENTS:  # an Xid storm: keep the newest, the state stays small
        events = dict(sorted(events.items(), key=lambda kv: kv[1]["time"])[-MAX_EVENTS:])
    fatal = xid_catalog.fatal_set(cfg.fatal, cfg.extra_fatal, cfg.not_fatal)
    by_gpu = {pci_key(k): v for k, v in (gpu_by_pci or {}).items()}

    groups: dict[tuple[str, int, bool], list[dict[str, Any]]] = {}
    for ev in events.values():
        is_fatal = xid_catalog.is_fatal(ev["xid"], ev["text"], fatal)
        groups.setdefault((ev["pci"], ev["xid"], is_fatal), []).append(ev)
    findings: list[Finding] = []
    for (pci, xid, is_fatal), evs in sorted(groups.items(), key=lambda kv: -max(
            e["time"] for e in kv[1])):
        last = max(e["time"] for e in evs)
        gpu = by_gpu.get(pci)
        subject = f"gpu{gpu}" if gpu is not None else f"PCI:{pci}"
        times = f" x{len(evs)}" if len(evs) > 1 else ""
        message = f"{subject} XID {xid} ({xid_catalog.meaning(xid)}){times} {_clock(last, now)}"
        data = {"xid": xid, "pci": pci, "gpu": gpu, "count": len(evs), "time": last,
                "text": evs[-1]["text"]}
        if is_fatal:
            findings.append(fail(NAME, subject, message, **data))
        elif job_start is not None and last >= job_start:
            findings.append(warn(NAME, subject, message + " during the job", **data))
        else:
            findings.append(ok(NAME, subject, message + " (not fatal)", **data))
    if not findings:
        findings.append(ok(NAME, "kernel-log", f"no Xid in the last {cfg.window_s}s"))
    return CheckResult(findings, {"boot_id": boot_id, "events": events})
