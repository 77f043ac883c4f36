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

from slurm_resilience import safefs
from slurm_resilience.config import Config
from slurm_resilience.config.health import (
    DiagCheckSection,
    GdrCheckSection,
    GpuCheckSection,
    InfinibandCheckSection,
    KernelLogCheckSection,
    MountsCheckSection,
    NvmeCheckSection,
    ServicesCheckSection,
    XidCheckSection,
)
from slurm_resilience.config.paths import node_path
from slurm_resilience.health import childproc, xid_repairs
from slurm_resilience.health.checks import gpu as gpu_check
from slurm_resilience.health.checks import host_signals as host_check
from slurm_resilience.health.checks import infiniband as ib_check
from slurm_resilience.health.checks import mounts as mounts_check
from slurm_resilience.health.checks import nvme as nvme_check
from slurm_resilience.health.checks import xid as xid_check
from slurm_resilience.health.collectors.infiniband import IbSnapshot
from slurm_resilience.health.collectors.mounts import MountsSnapshot
from slurm_resilience.health.collectors.nvme import NvmeSnapshot
from slurm_resilience.health.collectors.nvml_types import NvmlSnapshot
from slurm_resilience.health.collectors.xid import KernelLogSnapshot
from slurm_resilience.health.findings import (
    CheckResult,
    Finding,
    Severity,
    fail,
    unknown,
    warn,
    with_gpu_identity,
)
from slurm_resilience.health.verdict import Verdict, decide
from slurm_resilience.log import get_logger

CHECKS = ("gpu", "xid", "kernel", "infiniband", "nvme", "mounts", "services", "diag", "gdr")
# Active checks load the GPUs (and HCAs) for minutes: they run only when a caller names them.
ACTIVE = ("diag", "gdr")
# Order of findings in a drain reason: an Xid names the event behind a GPU's state.
_REASON_ORDER = ("xid", "gpu", "diag", "kernel", "services", "infiniband", "gdr", "nvme",
                 "mounts", "gate")
# Checks that judge another check's collector: the kernel log is read once for both.
_COLLECTOR_OF = {"kernel": "xid"}


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
        tmp = os.path.basename(self._path(f".{name}.{os.getpid()}"))
        safefs.write_atomic_path(self._path(name), json.dumps(data).encode(), durable=False,
                                 tmp=tmp)

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
    from slurm_resilience.health.collectors import infiniband, mounts, nvme, nvml, xid

    h = cfg.health
    jobs: dict[str, Callable[[], dict[str, Any]]] = {}
    if "gpu" in wanted:
        scen = node_path(h.scenario_dir, node) if h.scenario_dir else ""
        modules = node_path(h.gpu.modules_file, node) if h.gpu.peermem != "off" else ""
        pci = node_path(h.gpu.pci_sysfs_root, node) if h.gpu.pci_sysfs_root else ""
        jobs["gpu"] = functools.partial(nvml.collect_json, h.backend, scen, node, modules, pci)
    if "xid" in wanted or "kernel" in wanted:
        read = functools.partial(
            xid.collect, h.xid.source, node_path(h.xid.path, node),
            node_path(h.xid.boot_id_file, node), h.xid.max_read_bytes,
            max(h.xid.window_s, h.kernel_log.window_s), h.collector_timeout_s)
        jobs["xid"] = lambda: read().to_json()
    if "infiniband" in wanted:
        jobs["infiniband"] = functools.partial(
            infiniband.collect_json, node_path(h.infiniband.sysfs_root, node),
            list(h.infiniband.max_counter_delta))
    if "nvme" in wanted:
        jobs["nvme"] = functools.partial(
            nvme.collect_json, node_path(h.nvme.path, node), size_limit=h.nvme.size_limit,
            active=active and h.nvme.probe, smart=active and h.nvme.smart,
            device=h.nvme.device, timeout=h.collector_timeout_s,
            reclaim_dir=node_path(cfg.node.state_dir, node) if cfg.checkpoint.enabled else "",
            reclaim_below=int(h.nvme.min_free))
    if "mounts" in wanted:
        jobs["mounts"] = functools.partial(
            mounts.collect_json, [node_path(p, node) for p in h.mounts.paths],
            h.mounts.timeout_s)
    if "services" in wanted:
        from slurm_resilience.health.collectors import services

        jobs["services"] = functools.partial(services.collect, list(h.services.units),
                                             h.collector_timeout_s / 2)
    if "diag" in wanted:
        from slurm_resilience.health.collectors import diag

        jobs["diag"] = functools.partial(diag.collect_json, h.diag.tool, h.diag.level,
                                         h.diag.timeout_s, h.diag.memtest_bytes,
                                         h.diag.memtest_iters)
    if "gdr" in wanted:
        from slurm_resilience.health.collectors import perftest

        jobs["gdr"] = functools.partial(
            perftest.collect_json, node_path(h.infiniband.sysfs_root, node), list(h.gdr.args),
            h.gdr.port, h.gdr.timeout_s, dict(h.gdr.gpu_by_hca), h.gdr.max_hcas)
    return jobs


def _gpu_map(store: StateStore, snap: NvmlSnapshot | None) -> dict[str, int]:
    """PCI address → GPU index, remembered across runs: a GPU that fell off the bus no
    longer tells NVML its address, yet its Xid must still name it."""
    by_pci = store.load("gpu_map").get("by_pci", {})
    if not isinstance(by_pci, dict):
        store.quarantine("gpu_map", f"by_pci is a {type(by_pci).__name__}, not an object")
        by_pci = {}
    known: dict[str, int] = {k: v for k, v in by_pci.items()
                             if isinstance(v, int) and not isinstance(v, bool)}
    current = {g.pci_bus_id: g.index for g in (snap.gpus if snap else []) if g.pci_bus_id}
    merged = {**known, **current}
    if merged != known:
        store.save_or_say("gpu_map", {"by_pci": merged})
    return merged


def _identities(snap: NvmlSnapshot | None, known: dict[str, int]) -> dict[int, dict[str, Any]]:
    """GPU index → PCI address and serial; a GPU NVML no longer lists keeps the address it
    had (its serial is not known then)."""
    out: dict[int, dict[str, Any]] = {i: {"pci_bus_id": bus, "serial": None}
                                      for bus, i in known.items()}
    for g in snap.gpus if snap else []:
        if g.pci_bus_id or g.serial:
            out[g.index] = {"pci_bus_id": g.pci_bus_id, "serial": g.serial}
    return out


def _gpus_ok(snap: NvmlSnapshot | None, known: dict[str, int]) -> dict[str, bool] | None:
    """PCI address → NVML answers for that GPU and it is not lost; a GPU we knew that NVML
    no longer lists is False. None when NVML gave no list (nothing to compare)."""
    if snap is None or snap.error or snap.no_driver:
        return None
    view = {xid_repairs.pci_key(g.pci_bus_id): not g.lost for g in snap.gpus if g.pci_bus_id}
    for bus_id in known:
        view.setdefault(xid_repairs.pci_key(bus_id), False)
    return view


def _record_diag_repairs(store: StateStore, gpu_by_pci: dict[str, int], covered: set[int],
                         now: float) -> list[Finding]:
    """A clean active diagnostic ends the fatal Xids of the GPUs it tested: each goes into
    the repair ledger, read by the Xid check of this run and every later one."""
    if not store.directory:
        return [warn("xid", "repairs", "clean diagnostic not recorded as a repair: no state "
                                       "directory")]
    try:
        for pci, index in sorted(gpu_by_pci.items()):
            if index in covered:
                xid_repairs.record(store.directory, xid_repairs.Repair(
                    pci, now, "active diagnostic passed"))
    except OSError as exc:
        return [warn("xid", "repairs", f"clean diagnostic not recorded as a repair: {exc}")]
    return []


def _timeout_finding(name: str, error: str) -> Finding:
    # A collector that hangs is itself the symptom (a GPU or disk stuck in the driver),
    # except the kernel log, where it only means we could not look.
    if name == "xid":
        return unknown(name, "collector", f"{name} collector: {error}")
    return fail(name, "collector", f"{name} collector hung: {error}")


@dataclass(frozen=True)
class _RunFacts:
    """What every check of one gate run may read besides its own snapshot and state."""

    cfg: Config
    kind: str
    wanted: tuple[str, ...]
    store: StateStore
    now: float
    expected_gpus: int | None
    job_gpus: frozenset[int] | None
    job_start: float | None
    gpu_snap: NvmlSnapshot | None
    gpu_by_pci: dict[str, int]


def _check(name: str, snap: dict[str, Any], prev: dict[str, Any], facts: _RunFacts
           ) -> tuple[CheckResult | None, list[Finding]]:
    """One check's result (None: its collector served only other checks) and findings of
    its own bookkeeping."""
    h, now, gpu_snap = facts.cfg.health, facts.now, facts.gpu_snap
    extra: list[Finding] = []
    if name == "gpu":
        if gpu_snap is None:
            return None, extra
        return gpu_check.check(gpu_snap, h.gpu, prev, kind=facts.kind, now=now,
                               expected_count=facts.expected_gpus,
                               job_gpus=facts.job_gpus), extra
    if name == "xid":
        klog = KernelLogSnapshot.from_json(snap)
        if "kernel" in facts.wanted:
            extra.extend(host_check.check(klog, h.kernel_log, now=now))
        if "xid" not in facts.wanted:
            return None, extra
        try:
            repairs, garbled = xid_repairs.load(facts.store.directory)
        except OSError as exc:
            # Without the ledger a repaired GPU stays failed: safe, and said.
            repairs, garbled = [], 0
            extra.append(warn("xid", "repairs", f"couldn't read {xid_repairs.LEDGER}: {exc}"))
        if garbled:
            extra.append(warn("xid", "repairs", f"{garbled} garbled line(s) in "
                                                f"{xid_repairs.LEDGER} skipped"))
        return xid_check.check(
            klog, h.xid, prev, now=now, gpu_by_pci=facts.gpu_by_pci,
            job_start=facts.job_start if facts.kind == "epilog" else None, repairs=repairs,
            gpus_ok=_gpus_ok(gpu_snap, facts.gpu_by_pci)), extra
    if name == "infiniband":
        model = next((g.name for g in gpu_snap.gpus if g.name), None) if gpu_snap else None
        return ib_check.check(IbSnapshot.from_json(snap), h.infiniband, prev,
                              gpu_model=model), extra
    if name == "diag":
        # Only when asked for, so its imports stay off the hooks' path.
        from slurm_resilience.health.checks import diag as diag_check
        from slurm_resilience.health.collectors import cuda_memtest, dcgm

        if "dcgm" in snap:
            report = dcgm.from_json(snap["dcgm"])
            result = diag_check.check_dcgm(report, prev, now)
            covered = {r.gpu for r in report.results if r.gpu is not None}
        else:
            memtest = cuda_memtest.from_json(snap["memtest"])
            result = diag_check.check_memtest(memtest, h.diag, prev, now)
            covered = {g.index for g in memtest.gpus}
        if result.state.get("last_clean") == now:
            extra.extend(_record_diag_repairs(facts.store, facts.gpu_by_pci, covered, now))
        return result, extra
    if name == "gdr":
        from slurm_resilience.health.checks import gdr as gdr_check
        from slurm_resilience.health.collectors.perftest import PerftestSnapshot

        return gdr_check.check(PerftestSnapshot.from_json(snap), h.gdr, prev), extra
    if name == "services":
        from slurm_resilience.health.checks import services as services_check

        return services_check.check(snap, h.services, prev), extra
    if name == "mounts":
        return mounts_check.check(MountsSnapshot.from_json(snap), h.mounts, prev), extra
    return nvme_check.check(NvmeSnapshot.from_json(snap), h.nvme, prev), extra


def run(cfg: Config, node: str, kind: str, *, expected_gpus: int | None = None,
        job_gpus: frozenset[int] | None = None, job_start: float | None = None,
        only: tuple[str, ...] = ()) -> GateReport:
    """Run the enabled checks for ``kind`` (prolog, epilog, healthcheck, manual)."""
    h = cfg.health
    sections: dict[str, GpuCheckSection | XidCheckSection | KernelLogCheckSection
                   | InfinibandCheckSection | NvmeCheckSection | MountsCheckSection
                   | ServicesCheckSection | DiagCheckSection | GdrCheckSection] = {
        "gpu": h.gpu, "xid": h.xid, "kernel": h.kernel_log, "infiniband": h.infiniband,
        "nvme": h.nvme, "mounts": h.mounts, "services": h.services, "diag": h.diag,
        "gdr": h.gdr}
    wanted = [n for n in CHECKS if sections[n].enabled and (not only or n in only)
              and (n not in ACTIVE or n in only)]
    if h.gpu.expected_count == 0 and "gpu" in wanted:
        wanted.remove("gpu")
    if not h.nvme.path and "nvme" in wanted:
        wanted.remove("nvme")
    if not h.mounts.paths and "mounts" in wanted:
        wanted.remove("mounts")
    if "services" in wanted and (not h.services.units or kind in ("prolog", "epilog")):
        wanted.remove("services")  # the hooks run no external command
    active = kind not in ("prolog", "epilog")
    started = time.monotonic()
    jobs = _collectors(cfg, node, active, wanted)
    slow = {n: jobs.pop(n) for n in ACTIVE if n in jobs}
    outcomes = childproc.run_all(jobs, h.collector_timeout_s)
    # One active test at a time: each loads the GPUs, and each is measured alone.
    limits = {"diag": h.diag.timeout_s, "gdr": (h.gdr.timeout_s + 2) * h.gdr.max_hcas + 5}
    for name, job in slow.items():
        outcomes.update(childproc.run_all({name: job}, limits[name]))
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
        for name in dict.fromkeys(_COLLECTOR_OF.get(n, n) for n in wanted):
            o = outcomes[name]
            if o.value is None:
                findings.append(_timeout_finding(name, o.error or "no answer") if o.timed_out
                                else unknown(name, "collector", f"{name} collector failed: "
                                                                f"{o.error}"))
            else:
                snaps[name] = o.value
        now = time.time()
        gpu_snap = NvmlSnapshot.from_json(snaps["gpu"]) if "gpu" in snaps else None
        gpu_by_pci = _gpu_map(store, gpu_snap)
        facts = _RunFacts(cfg, kind, tuple(wanted), store, now, expected_gpus, job_gpus,
                          job_start, gpu_snap, gpu_by_pci)
        # A clean diagnostic is repair evidence the Xid check reads: judge it first.
        for name, snap in sorted(snaps.items(), key=lambda item: item[0] != "diag"):
            prev = store.load(name)
            try:
                result, extra = _check(name, snap, prev, facts)
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                if not prev:
                    raise
                # Saved state of the wrong shape: judge this run without history.
                store.quarantine(name, f"the {name} check couldn't use it: "
                                       f"{type(exc).__name__}: {exc}")
                prev = {}
                result, extra = _check(name, snap, prev, facts)
            findings.extend(extra)
            if result is None:
                continue
            if result.state != prev:
                store.save_or_say(name, result.state)
            findings.extend(result.findings)
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
    seconds["total"] = time.monotonic() - started
    findings = with_gpu_identity(findings, _identities(gpu_snap, gpu_by_pci))
    policies: dict[str, str] = {name: sections[name].on_unknown for name in CHECKS}
    findings.sort(key=lambda f: (-int(f.severity), _REASON_ORDER.index(f.check), f.subject))
    return GateReport(kind, node, decide(findings, policies), seconds)


def worst(report: GateReport) -> Severity:
    return max((f.severity for f in report.findings), default=Severity.OK)
