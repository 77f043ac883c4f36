"""The gate: collectors (in children, with a hard timeout) → checks → verdict.

Which collectors run depends on the hook: the prolog only reads (no write
probe, no external commands), the epilog adds the Xids raised during the job,
HealthCheckProgram and ``slurm-resilience check`` run everything.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slurm_resilience.config import Config
from slurm_resilience.config.health import (
    GpuCheckSection,
    InfinibandCheckSection,
    NvmeCheckSection,
    XidCheckSection,
)
from slurm_resilience.config.paths import node_path
from slurm_resilience.health import childproc
from slurm_resilience.health.checks import gpu as gpu_check
from slurm_resilience.health.checks import infiniband as ib_check
from slurm_resilience.health.checks import nvme as nvme_check
from slurm_resilience.health.checks import xid as xid_check
from slurm_resilience.health.findings import (
    CheckResult,
    Finding,
    Severity,
    fail,
    unknown,
    warn,
)
from slurm_resilience.health.verdict import Verdict, decide
from slurm_resilience.log import get_logger

CHECKS = ("gpu", "xid", "infiniband", "nvme")
# Order of findings in a drain reason: an Xid names the event behind a GPU's state.
_REASON_ORDER = ("xid", "gpu", "infiniband", "nvme", "gate")


@dataclass
class GateReport:
    """Everything one gate run found, for steps, the CLI and logs."""

    kind: str
    node: str
    verdict: Verdict
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def findings(self) -> list[Finding]:
        return self.verdict.findings

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "kind": self.kind, "healthy": self.verdict.healthy,
                "reason": self.verdict.reason() if not self.verdict.healthy else "",
                "findings": [f.to_dict() for f in self.findings],
                "seconds": {k: round(v, 4) for k, v in self.seconds.items()}}


def state_dir(cfg: Config, node: str) -> str:
    template = cfg.health.state_dir or os.path.join(cfg.node.state_dir, "health")
    return node_path(template, node)


MAX_STATE_BYTES = 1 << 20  # far above any real state; a bigger file is garbage


class StateStore:
    """One JSON file per check under the node's health state directory (root-owned, 0700)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.quarantined: set[str] = set()  # names found unusable by this store

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.json")

    def load(self, name: str) -> dict[str, Any]:
        """The saved state, or {} when there is none or it can't be used; an unusable
        file (garbage, truncated, huge, not an object) is set aside and said."""
        if not self.directory:
            return {}
        try:
            fd = os.open(self._path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self.quarantine(name, f"couldn't open it: {exc.strerror}")
            return {}
        try:
            with os.fdopen(fd, "rb") as fh:
                raw = fh.read(MAX_STATE_BYTES + 1)
            if len(raw) > MAX_STATE_BYTES:
                raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
            data = json.loads(raw)
        except (OSError, ValueError) as exc:
            # A corrupt state file only costs one baseline; say so and start afresh.
            self.quarantine(name, str(exc)[:200])
            return {}
        if not isinstance(data, dict):
            self.quarantine(name, f"a JSON {type(data).__name__}, not an object")
            return {}
        return data

    def quarantine(self, name: str, why: str) -> None:
        """Set an unusable state file aside (one ``.corrupt`` copy kept for a look), so
        the next run starts afresh instead of tripping on it again."""
        path = self._path(name)
        self.quarantined.add(name)
        try:
            os.replace(path, path + ".corrupt")
            kept: str | None = path + ".corrupt"
        except OSError:
            kept = None  # a read-only state dir: the next save replaces it anyway
        get_logger("health").warning("health: couldn't use a state file; starting afresh",
                                     path=path, reason=why, set_aside_as=kept)

    def save(self, name: str, data: dict[str, Any]) -> None:
        if not self.directory:
            return  # no usable state directory: this run keeps nothing
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        tmp = self._path(f".{name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, self._path(name))

    def save_or_say(self, name: str, data: dict[str, Any]) -> None:
        """:meth:`save`, best-effort: a full or read-only state dir costs the history of
        the next run, never this run's verdict."""
        try:
            self.save(name, data)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(self._path(f".{name}.{os.getpid()}"))
            get_logger("health").warning("health: couldn't save a state file; the next run "
                                         "starts without this one's history",
                                         path=self._path(name), error=str(exc))

    def lock(self) -> int:
        """An exclusive lock over load→check→save, so concurrent hooks don't interleave."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(self.directory, ".lock"),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd


def _collectors(cfg: Config, node: str, active: bool, wanted: list[str]
                ) -> dict[str, Callable[[], dict[str, Any]]]:
    from slurm_resilience.health.collectors import infiniband, nvme, nvml, xid

    h = cfg.health
    jobs: dict[str, Callable[[], dict[str, Any]]] = {}
    if "gpu" in wanted:
        scen = node_path(h.scenario_dir, node) if h.scenario_dir else ""
        jobs["gpu"] = functools.partial(nvml.collect, h.backend, scen, node)
    if "xid" in wanted:
        jobs["xid"] = functools.partial(
            xid.collect, h.xid.source, node_path(h.xid.path, node),
            node_path(h.xid.boot_id_file, node), h.xid.max_read_bytes, h.xid.window_s,
            h.collector_timeout_s)
    if "infiniband" in wanted:
        jobs["infiniband"] = functools.partial(
            infiniband.collect, node_path(h.infiniband.sysfs_root, node),
            list(h.infiniband.max_counter_delta))
    if "nvme" in wanted:
        jobs["nvme"] = functools.partial(
            nvme.collect, node_path(h.nvme.path, node), size_limit=h.nvme.size_limit,
            active=active and h.nvme.probe, smart=active and h.nvme.smart,
            device=h.nvme.device, timeout=h.collector_timeout_s)
    return jobs


def _gpu_map(store: StateStore, snap: dict[str, Any]) -> dict[str, int]:
    """PCI address → GPU index, remembered across runs: a GPU that fell off the bus no
    longer tells NVML its address, yet its Xid must still name it."""
    by_pci = store.load("gpu_map").get("by_pci", {})
    if not isinstance(by_pci, dict):
        store.quarantine("gpu_map", f"by_pci is a {type(by_pci).__name__}, not an object")
        by_pci = {}
    known: dict[str, int] = {k: v for k, v in by_pci.items()
                             if isinstance(v, int) and not isinstance(v, bool)}
    current = {g["pci_bus_id"]: int(g["index"]) for g in snap.get("gpus", [])
               if g.get("pci_bus_id")}
    merged = {**known, **current}
    if merged != known:
        store.save_or_say("gpu_map", {"by_pci": merged})
    return merged


def _timeout_finding(name: str, error: str) -> Finding:
    # A collector that hangs is itself the symptom (a GPU or disk stuck in the driver),
    # except the kernel log, where it only means we could not look.
    if name == "xid":
        return unknown(name, "collector", f"{name} collector: {error}")
    return fail(name, "collector", f"{name} collector hung: {error}")


def _check(name: str, snap: dict[str, Any], prev: dict[str, Any], cfg: Config, kind: str,
           expected_gpus: int | None, job_gpus: frozenset[int] | None, now: float,
           gpu_by_pci: dict[str, int], job_start: float | None) -> CheckResult:
    h = cfg.health
    if name == "gpu":
        return gpu_check.check(snap, h.gpu, prev, kind=kind, expected_count=expected_gpus,
                               job_gpus=job_gpus)
    if name == "xid":
        return xid_check.check(snap, h.xid, prev, now=now, gpu_by_pci=gpu_by_pci,
                               job_start=job_start if kind == "epilog" else None)
    if name == "infiniband":
        return ib_check.check(snap, h.infiniband, prev)
    return nvme_check.check(snap, h.nvme, prev)


def run(cfg: Config, node: str, kind: str, *, expected_gpus: int | None = None,
        job_gpus: frozenset[int] | None = None, job_start: float | None = None,
        only: tuple[str, ...] = ()) -> GateReport:
    """Run the enabled checks for ``kind`` (prolog, epilog, healthcheck, manual)."""
    h = cfg.health
    sections: dict[str, GpuCheckSection | XidCheckSection | InfinibandCheckSection
                   | NvmeCheckSection] = {
        "gpu": h.gpu, "xid": h.xid, "infiniband": h.infiniband, "nvme": h.nvme}
    wanted = [n for n in CHECKS if sections[n].enabled and (not only or n in only)]
    if h.gpu.expected_count == 0 and "gpu" in wanted:
        wanted.remove("gpu")
    if not h.nvme.path and "nvme" in wanted:
        wanted.remove("nvme")
    active = kind not in ("prolog", "epilog")
    started = time.monotonic()
    outcomes = childproc.run_all(_collectors(cfg, node, active, wanted), h.collector_timeout_s)
    seconds = {name: o.seconds for name, o in outcomes.items()}
    findings: list[Finding] = []
    store = StateStore(state_dir(cfg, node))
    try:
        lock_fd = store.lock()
    except OSError as exc:
        # Not root (a user running `check`), or the state disk is broken: judge this
        # run on its own; counter deltas and Xid history need the state.
        findings.append(warn("gate", "state", f"couldn't open state in {store.directory}: "
                                              f"{exc.strerror}; checks run without history"))
        store = StateStore("")
        lock_fd = -1
    try:
        snaps: dict[str, dict[str, Any]] = {}
        for name in wanted:
            o = outcomes[name]
            if o.value is None:
                findings.append(_timeout_finding(name, o.error or "no answer") if o.timed_out
                                else unknown(name, "collector", f"{name} collector failed: "
                                                                f"{o.error}"))
            else:
                snaps[name] = o.value
        now = time.time()
        gpu_by_pci = _gpu_map(store, snaps.get("gpu", {}))
        for name, snap in snaps.items():
            prev = store.load(name)
            try:
                result = _check(name, snap, prev, cfg, kind, expected_gpus, job_gpus, now,
                                gpu_by_pci, job_start)
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                if not prev:
                    raise
                # Saved state of the wrong shape: judge this run without history.
                store.quarantine(name, f"the {name} check couldn't use it: "
                                       f"{type(exc).__name__}: {exc}")
                prev = {}
                result = _check(name, snap, prev, cfg, kind, expected_gpus, job_gpus, now,
                                gpu_by_pci, job_start)
            if result.state != prev:
                store.save_or_say(name, result.state)
            findings.extend(result.findings)
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
    seconds["total"] = time.monotonic() - started
    policies: dict[str, str] = {name: sections[name].on_unknown for name in CHECKS}
    findings.sort(key=lambda f: (-int(f.severity), _REASON_ORDER.index(f.check), f.subject))
    return GateReport(kind, node, decide(findings, policies), seconds)


def worst(report: GateReport) -> Severity:
    return max((f.severity for f in report.findings), default=Severity.OK)
