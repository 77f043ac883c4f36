"""The gate: collectors (in children, with a hard timeout) → checks → verdict.

Which collectors run depends on the hook: the prolog only reads (no write
probe, no external commands), the epilog adds the Xids raised during the job,
HealthCheckProgram and ``slurm-resilience check`` run everything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from slurm_resilience import safefs
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.health import childproc, registry
from slurm_resilience.health.checks.spec import CheckSpec, RunFacts, StateRecord, int_map, obj
from slurm_resilience.health.collectors.nvml_types import NvmlSnapshot
from slurm_resilience.health.findings import (
    Finding,
    Severity,
    fail,
    unknown,
    warn,
    with_gpu_identity,
)
from slurm_resilience.health.nvlink_domain import RECORD as NVLINK_RECORD
from slurm_resilience.health.nvlink_domain import NodeFabric
from slurm_resilience.health.verdict import Verdict, decide
from slurm_resilience.log import get_logger

# Every check, in the registry's order (health.registry declares them).
CHECKS = registry.NAMES
# Active checks load the GPUs (and HCAs) for minutes: they run only when a caller names them.
ACTIVE = registry.ACTIVE
GPU_MAP = "gpu_map"


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
St = TypeVar("St", bound=StateRecord)


@dataclass(frozen=True)
class GpuMap:
    """PCI address → GPU index of every GPU this node has shown."""

    by_pci: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GpuMap:
        return cls(int_map(obj(data.get("by_pci"), "by_pci"), "by_pci"))

    def to_json(self) -> dict[str, Any]:
        return {"by_pci": dict(self.by_pci)}


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

    def load_state(self, name: str, kind: type[St]) -> St:
        """The check's saved record (a :class:`~.checks.spec.StateRecord`), or an empty one
        when there is none or it can't be used; a file of the wrong shape is set aside and
        said, as an unreadable one is."""
        data = self.load(name)
        try:
            record: St = kind.from_json(data)
        except ValueError as exc:
            self.quarantine(name, f"the {name} check can't use it: {exc}"[:300])
            return kind()
        return record

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


def _gpu_map(store: StateStore, snap: NvmlSnapshot | None) -> dict[str, int]:
    """PCI address → GPU index, remembered across runs: a GPU that fell off the bus no
    longer tells NVML its address, yet its Xid must still name it."""
    known = store.load_state(GPU_MAP, GpuMap).by_pci
    current = {g.pci_bus_id: g.index for g in (snap.gpus if snap else []) if g.pci_bus_id}
    merged = {**known, **current}
    if merged != known:
        store.save_or_say(GPU_MAP, GpuMap(merged).to_json())
    return merged


def _record_nvlink_domain(store: StateStore, node: str, snap: NvmlSnapshot | None) -> None:
    """Save the GPUs' NVLink fabric (domain and health) when it changed: what
    ``topology generate --from-nvlink-domains`` groups nodes by."""
    if snap is None or not any(g.fabric is not None for g in snap.gpus):
        return
    now = NodeFabric.from_snapshot(node, snap, time.time())
    try:
        saved = NodeFabric.from_json(store.load(NVLINK_RECORD)) if store.directory else None
    except (ValueError, TypeError):
        saved = None
    if saved is None or not saved.same_fabric(now):
        store.save_or_say(NVLINK_RECORD, now.to_json())


def _identities(snap: NvmlSnapshot | None, known: dict[str, int]
                ) -> dict[int, dict[str, str | None]]:
    """GPU index → PCI address and serial; a GPU NVML no longer lists keeps the address it
    had (its serial is not known then)."""
    out: dict[int, dict[str, str | None]] = {i: {"pci_bus_id": bus, "serial": None}
                                             for bus, i in known.items()}
    for g in snap.gpus if snap else []:
        if g.pci_bus_id or g.serial:
            out[g.index] = {"pci_bus_id": g.pci_bus_id, "serial": g.serial}
    return out


def _collector_finding(spec: CheckSpec[Any, Any], outcome: childproc.Outcome) -> Finding:
    name = spec.name
    if outcome.timed_out and spec.hang_is_sick:
        # A collector that hangs is itself the symptom (a GPU or disk stuck in the driver).
        return fail(name, "collector", f"{name} collector hung: {outcome.error or 'no answer'}")
    if outcome.timed_out:
        return unknown(name, "collector", f"{name} collector: {outcome.error or 'no answer'}")
    return unknown(name, "collector", f"{name} collector failed: {outcome.error}")


def _judge(spec: CheckSpec[Any, Any], raw: dict[str, Any], store: StateStore,
           facts: RunFacts) -> list[Finding]:
    """One check on its collector's snapshot and its saved state; saves the new state."""
    prev = store.load_state(spec.name, spec.state)
    try:
        result, extra = spec.judge(spec.snapshot(raw), prev, facts)
    except Exception as exc:  # noqa: BLE001 - a crashed check never passes the node
        get_logger("health").exception("health: a check crashed", check=spec.name)
        return [fail(spec.name, "check", f"{spec.name} check crashed: {type(exc).__name__}: "
                                         f"{exc}"[:200])]
    if result is None:
        return extra
    if result.state != prev:
        store.save_or_say(spec.name, result.state.to_json())
    return [*extra, *result.findings]


def run(cfg: Config, node: str, kind: str, *, expected_gpus: int | None = None,
        job_gpus: frozenset[int] | None = None, job_start: float | None = None,
        only: tuple[str, ...] = ()) -> GateReport:
    """Run the enabled checks for ``kind`` (prolog, epilog, healthcheck, manual)."""
    h = cfg.health
    wanted = [s for s in registry.SPECS if s.section(h).enabled and (not only or s.name in only)
              and (not s.active or s.name in only) and s.applies(h, kind)]
    names = tuple(s.name for s in wanted)
    active = kind not in ("prolog", "epilog")
    started = time.monotonic()
    sources = {s.source for s in wanted}
    jobs = {s.name: s.collect(cfg, node, active) for s in registry.SPECS
            if s.name in sources and s.collect is not None and not s.active}
    outcomes = childproc.run_all(jobs, h.collector_timeout_s)
    # One active test at a time: each loads the GPUs, and each is measured alone.
    for s in wanted:
        if s.active_limit is not None and s.collect is not None:
            outcomes.update(childproc.run_all({s.name: s.collect(cfg, node, active)},
                                              s.active_limit(h)))
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
        for source in registry.SPECS:
            if source.name in outcomes:
                o = outcomes[source.name]
                if o.value is None:
                    findings.append(_collector_finding(source, o))
                else:
                    snaps[source.name] = o.value
        gpu_snap = NvmlSnapshot.from_json(snaps["gpu"]) if "gpu" in snaps else None
        gpu_by_pci = _gpu_map(store, gpu_snap)
        _record_nvlink_domain(store, node, gpu_snap)
        facts = RunFacts(cfg, kind, names, store.directory, time.time(), expected_gpus,
                         job_gpus, job_start, gpu_snap, gpu_by_pci)
        for spec in sorted(wanted, key=lambda s: not s.first):
            if spec.source in snaps:
                findings.extend(_judge(spec, snaps[spec.source], store, facts))
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
    seconds["total"] = time.monotonic() - started
    findings = with_gpu_identity(findings, _identities(gpu_snap, gpu_by_pci))
    policies = {s.name: s.section(h).on_unknown for s in registry.SPECS}
    rank = {s.name: s.rank for s in registry.SPECS}
    findings.sort(key=lambda f: (-int(f.severity), rank.get(f.check, len(rank)), f.subject))
    return GateReport(kind, node, decide(findings, policies), seconds)


def worst(report: GateReport) -> Severity:
    return max((f.severity for f in report.findings), default=Severity.OK)
