"""The configuration schema: one frozen dataclass per section.

Each capability owns a section. Sections that belong to a larger subsystem
live next to their code's config module and are imported here, so this file
stays the single index of every key (``conf/config.example.yaml`` documents
each one, and a test keeps the two in step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slurm_resilience.config import DEFAULT_PATH, ENV_VAR  # noqa: F401 - kept importable
from slurm_resilience.config.agent import AgentSection
from slurm_resilience.config.checkpoint import CheckpointSection
from slurm_resilience.config.health import HealthSection
from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.config.loader import ByteSize, setting
from slurm_resilience.config.metrics import MetricsSection, StragglerSection
from slurm_resilience.config.nccl import NcclSection
from slurm_resilience.config.topology import TopologySection


@dataclass(frozen=True)
class SlurmSection:
    """How the adapter reaches Slurm."""

    backend: Literal["cli"] = setting(
        "cli", help="cli runs scontrol/squeue/sinfo, the only backend (see README: no pyslurm)"
    )
    bin_dir: str = setting("", help="directory holding scontrol/squeue/sinfo; empty: PATH")
    timeout_s: float = setting(10.0, min=0.5, max=300, help="hard timeout of each Slurm command")
    reason_prefix: str = setting(
        "SR:", help="prefix of every drain reason we set; we only resume nodes whose reason has it"
    )
    reason_owners: Literal["first", "last"] = setting(
        "first", help="where a drain reason names the steps that set it: first "
        "('SR: health: gpu3 XID 79 ...') or last ('SR: gpu3 XID 79 ... [by health]', so the "
        "finding reads in sinfo -R's default 20 characters); both are always recognised"
    )
    conf: str = setting("", help="SLURM_CONF to use; empty: Slurm's own default")

    def validate(self) -> None:
        if not self.reason_prefix.strip():
            raise ValueError("reason_prefix must not be empty: it is how we recognise our drains")


@dataclass(frozen=True)
class LoggingSection:
    """Where hooks and daemons write their JSON lines."""

    level: Literal["debug", "info", "warning", "error"] = setting("info", help="minimum level")
    file: str = setting(
        "/var/log/slurm-resilience/events.jsonl", help="JSON-lines log of hooks and daemons"
    )
    syslog: bool = setting(True, help="also send events to syslog/journald when /dev/log exists")


@dataclass(frozen=True)
class JobTmpfsSection:
    """A size- and inode-limited tmpfs the prolog mounts on each job's run directory."""

    enabled: bool = setting(
        True, help="mount one on every job's run directory (false: a plain directory, bounded "
                   "only by the filesystem under node.run_dir)")
    # A 256-byte slot still takes a 4 KiB tmpfs page: 4096 slots (hang.slotreader.MAX_SLOTS)
    # need 16 MiB. Pages are charged to the memory cgroup of the job that writes them.
    size: ByteSize = setting(
        ByteSize(32 << 20), help="most bytes one job can write there (tmpfs size=)")
    inodes: int = setting(
        8192, min=64, max=10_000_000, help="most files and directories one job can create "
                                           "there (tmpfs nr_inodes=)")

    def validate(self) -> None:
        if self.size < 1 << 20:
            raise ValueError("node.job_tmpfs.size must be at least 1MiB")


@dataclass(frozen=True)
class NodeSection:
    """Facts about the node this process runs on."""

    name: str = setting("", help="Slurm node name; empty: SLURMD_NODENAME, then the short hostname")
    state_dir: str = setting(
        "/var/lib/slurm-resilience", help="root-owned directory for caches, journals, state files"
    )
    run_dir: str = setting(
        "/var/spool/slurm-resilience",
        help="per-job directories (heartbeat slots) and job records; not on /run, whose small "
             "tmpfs munge, systemd and every daemon's pid file share with it",
    )
    job_tmpfs: JobTmpfsSection = setting(
        default_factory=JobTmpfsSection,
        help="bound what one job can put in its run directory")


@dataclass(frozen=True)
class HooksSection:
    """Bounds and failure policy of the prolog, epilog and HealthCheckProgram."""

    prolog_timeout_s: float = setting(
        20.0, min=1, max=600, help="hard limit of the whole prolog; keep under PrologEpilogTimeout"
    )
    epilog_timeout_s: float = setting(60.0, min=1, max=3600, help="hard limit of the whole epilog")
    healthcheck_timeout_s: float = setting(
        60.0, min=1, max=3600, help="hard limit of one HealthCheckProgram run"
    )
    on_internal_error: Literal["fail-open", "fail-closed"] = setting(
        "fail-open",
        help="a bug or crash in a hook step, or a hook past its limit: fail-open logs it and "
             "lets the job run; fail-closed drains the node with an SR: reason",
    )
    server: Literal["service", "agent", "off"] = setting(
        "service", help="who runs the hook server that hooks hand their work to (tens of ms "
                        "instead of a few hundred): service (slurm-resilience-hooks.service), "
                        "agent (the node agent starts it: nodes without systemd), off; a hook "
                        "that finds none, or is refused, runs in its own process and logs why")
    watchdog_grace_s: float = setting(
        10.0, min=1, max=120,
        help="after a hook's limit, how long its watchdog may spend draining with our reason "
             "(fail-closed); set slurm.conf's PrologEpilogTimeout above the limit plus this",
    )


@dataclass(frozen=True)
class Config:
    """The whole configuration file."""

    mode: Literal["enforce", "observe"] = setting(
        "enforce",
        help="observe: the health gate, the NCCL test, hang handling and the stragglers run "
             "as usual and report what they would do (log, `status`, metrics: \"would drain "
             "node7: ...\"), and act on nothing: no drain, resume, requeue, hold, cancel or "
             "exclusion, and a prolog never fails a job (hang handling decides as its "
             "heartbeat.mode says; its steps are recorded, not carried out)")
    slurm: SlurmSection = setting(default_factory=SlurmSection, help="the Slurm adapter")
    logging: LoggingSection = setting(default_factory=LoggingSection, help="logging")
    node: NodeSection = setting(default_factory=NodeSection, help="this node")
    hooks: HooksSection = setting(default_factory=HooksSection, help="prolog/epilog/healthcheck")
    health: HealthSection = setting(default_factory=HealthSection, help="node health gate")
    agent: AgentSection = setting(default_factory=AgentSection, help="the node agent daemon")
    heartbeat: HeartbeatSection = setting(default_factory=HeartbeatSection, help="hang detection")
    checkpoint: CheckpointSection = setting(
        default_factory=CheckpointSection, help="checkpoint staging (NVMe tier, S3 tier)")
    nccl: NcclSection = setting(default_factory=NcclSection, help="NCCL loopback gate")
    topology: TopologySection = setting(
        default_factory=TopologySection, help="fabric discovery and leaf pinning")
    metrics: MetricsSection = setting(
        default_factory=MetricsSection, help="the agent's Prometheus metrics")
    stragglers: StragglerSection = setting(
        default_factory=StragglerSection, help="naming persistently slow ranks and nodes")

    def validate(self) -> None:
        from slurm_resilience.config.budgets import conflicts

        found = conflicts(self)
        if found:
            raise ValueError("; ".join(c.message() for c in found))
