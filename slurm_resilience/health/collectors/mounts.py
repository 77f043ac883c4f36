"""Reachability of the shared filesystems a site lists (``health.mounts.paths``).

Each path is probed in its own forked child with a bounded timeout: a hung NFS or
Lustre server leaves ``stat`` in uninterruptible sleep, and that child is abandoned
(:mod:`slurm_resilience.health.childproc`) while the others still answer.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slurm_resilience.health import childproc


@dataclass
class MountProbe:
    path: str
    reachable: bool = False
    mountpoint: bool | None = None
    error: str | None = None
    timed_out: bool = False
    ms: float | None = None


@dataclass
class MountsSnapshot:
    probes: list[MountProbe] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MountsSnapshot:
        return cls([MountProbe(**p) for p in d.get("probes", [])])


def _probe(path: str) -> dict[str, Any]:
    """stat + statvfs go to the server on a network filesystem: the reachability test."""
    started = time.monotonic()
    try:
        os.stat(path)
        os.statvfs(path)
    except OSError as exc:
        return {"error": f"{exc.strerror or exc}"}
    return {"ms": (time.monotonic() - started) * 1000.0, "mountpoint": os.path.ismount(path)}


def collect(paths: list[str], timeout: float,
            probe: Callable[[str], dict[str, Any]] = _probe) -> MountsSnapshot:
    """``probe`` is replaceable so tests can stand in for a server that never answers."""
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        p: functools.partial(probe, p) for p in paths}
    outcomes = childproc.run_all(jobs, timeout) if jobs else {}
    snap = MountsSnapshot()
    for path in paths:
        o = outcomes[path]
        found = MountProbe(path, timed_out=o.timed_out)
        if o.value is None:
            found.error = o.error or "no answer"
        elif o.value.get("error"):
            found.error = str(o.value["error"])
        else:
            found.reachable = True
            found.ms = float(o.value["ms"])
            found.mountpoint = bool(o.value["mountpoint"])
        snap.probes.append(found)
    return snap


def collect_json(paths: list[str], timeout: float) -> dict[str, Any]:
    return collect(paths, timeout).to_json()
