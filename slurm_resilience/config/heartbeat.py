"""Configuration of hang detection: the ``heartbeat`` section.

Every timeout that can end a job is kept below PyTorch's NCCL timeout (minus a
margin), so evidence is captured and the job requeued before PyTorch's own
watchdog kills the processes without a word.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from slurm_resilience.config.loader import ByteSize, setting

DEFAULT_SECTIONS: Mapping[str, float] = MappingProxyType({"checkpoint": 900.0, "eval": 1800.0})


@dataclass(frozen=True)
class ExchangeSection:
    """The agents' network exchange of hang observations (``heartbeat.exchange``), used when
    no shared rendezvous directory is configured: munge-authenticated TCP, fanned in
    through a tree rooted at the job's batch host."""

    port: int = setting(
        6828, min=1, max=65535,
        help="TCP port of every agent's exchange listener; a port below 1024 keeps users "
             "from binding it before the agent starts",
    )
    ports: dict[str, int] = setting(
        default_factory=dict,
        help="per-node port overriding `port` (node name -> port), for several agents on "
             "one host (the sandbox)",
    )
    bind: str = setting("0.0.0.0", help="address the listener binds")  # noqa: S104 - agents on other nodes connect
    addresses: dict[str, str] = setting(
        default_factory=dict,
        help="node name -> address to reach its agent; nodes not listed are looked up in "
             "Slurm (NodeAddr, else NodeHostName)",
    )
    fanout: int = setting(
        16, min=1, max=4096,
        help="children per node of the fan-in tree rooted at the batch host: no agent "
             "receives from more than this many peers for one incident",
    )
    munge_socket: str = setting("", help="munged's socket; empty: munge's default")
    munge: str = setting("munge", help="the munge program")
    unmunge: str = setting("unmunge", help="the unmunge program")
    agent_uid: int = setting(
        0, min=0, help="uid the agents run as: only credentials of this uid (or 0) count")
    credential_ttl_s: int = setting(
        120, min=10, max=3600, help="lifetime of each message's munge credential")
    max_skew_s: float = setting(
        60.0, min=1, max=3600,
        help="a message whose credential was made further from this node's clock is refused")
    max_connections: int = setting(
        64, min=1, max=4096, help="connections the listener serves at once; more are closed")
    max_connections_per_peer: int = setting(
        8, min=1, max=4096, help="connections from one address served at once")
    io_timeout_s: float = setting(
        5.0, min=0.1, max=120,
        help="deadline of one connection, for the whole of it (connect, send, receive, "
             "answer), not for each read")
    privileged_ports: bool = setting(
        True,
        help="agents send from a source port below 1024 (only root may bind one) and the "
             "listener closes a connection from any other port at once, unread, so no user "
             "can hold its slots; agents not run as root need CAP_NET_BIND_SERVICE")
    max_message_bytes: ByteSize = setting(
        ByteSize(768 << 10),
        help="largest message (munge credential) sent or accepted; several pieces are "
             "split over messages below it (munged refuses payloads near 1 MiB)",
    )
    max_piece_bytes: ByteSize = setting(
        ByteSize(64 << 10), help="largest piece (one node's summary) published or accepted")
    send_timeout_s: float = setting(
        10.0, min=0.5, max=600,
        help="how long a node keeps trying to deliver its pieces (to its parent, then to "
             "ancestors nearer the batch host)",
    )
    forward_linger_s: float = setting(
        0.05, min=0, max=5,
        help="an inner node waits this long for more pieces before forwarding a batch")
    collect_after_s: float = setting(
        0.5, min=0, max=60,
        help="the batch host asks the run's nodes for their pieces when some are still "
             "missing this long into its wait")

    def port_of(self, node: str) -> int:
        return self.ports.get(node, self.port)

    def validate(self) -> None:
        if self.max_piece_bytes > self.max_message_bytes // 2:
            raise ValueError(f"max_piece_bytes={self.max_piece_bytes} must be at most half of "
                             f"max_message_bytes={self.max_message_bytes}")
        if self.max_message_bytes > 900 << 10:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} is over munged's "
                             "payload limit (about 900 KiB)")
        for node, port in self.ports.items():
            if not 1 <= port <= 65535:
                raise ValueError(f"ports.{node}={port} is not a TCP port")


@dataclass(frozen=True)
class HeartbeatSection:
    """Per-rank heartbeats and the node agent's hang watcher."""

    mode: Literal["act", "observe", "off"] = setting(
        "act", help="act: capture evidence, drain on evidence, verify suspects, requeue; "
                    "observe: detect and report only (for rollout); off: do not watch",
    )
    step_timeout_s: float = setting(
        300.0, min=1, max=86400, help="a rank with no beat for this long is hung (after warm-up)"
    )
    warmup_timeout_s: float = setting(
        480.0, min=1, max=86400,
        help="timeout before the first beat and during the warm-up steps (compile, NCCL init)",
    )
    warmup_steps: int = setting(
        2, min=0, max=1000, help="beats that still count as warm-up and use warmup_timeout_s"
    )
    section_timeouts_s: dict[str, float] = setting(
        default_factory=lambda: DEFAULT_SECTIONS,
        help="timeout of each named section (with section('checkpoint'): ...); a job may pass "
             "its own timeout to section()",
    )
    section_default_timeout_s: float = setting(
        1800.0, min=1, max=86400, help="timeout of a section not listed in section_timeouts_s"
    )
    min_timeout_s: float = setting(
        1.0, min=0.1, max=3600, help="lower bound of any timeout a job asks for"
    )
    nccl_timeout_s: float = setting(
        600.0, min=1, max=86400,
        help="PyTorch's NCCL collective timeout on this cluster; step and warm-up timeouts "
             "must stay below it minus nccl_margin_s",
    )
    nccl_margin_s: float = setting(
        60.0, min=0, max=3600, help="time kept for evidence and requeue before NCCL's watchdog"
    )
    auto_tune: bool = setting(
        False, help="derive the step timeout from observed step times (max over ranks times "
                    "auto_tune_factor), persisted per job across restarts",
    )
    auto_tune_factor: float = setting(
        10.0, min=1.5, max=1000, help="safety factor of the auto-tuned step timeout"
    )
    auto_tune_min_steps: int = setting(
        20, min=2, max=100000, help="beats seen on a rank before its step times are trusted"
    )
    interval_s: float = setting(1.0, min=0.1, max=60, help="how often the agent reads the slots")
    max_requeues: int = setting(
        3, min=0, max=100, help="hang requeues per job; the next hang holds the job"
    )
    require_checkpoint_progress: bool = setting(
        True, help="hold instead of requeue when the job's checkpoint did not advance since "
                   "the previous hang requeue",
    )
    drain: bool = setting(
        True, help="take blamed nodes out of service at all: drains on evidence and suspects "
                   "(mode act only)")
    evidence_timeout_s: float = setting(
        20.0, min=1, max=600, help="bound of all evidence capture of one incident"
    )
    py_spy: str = setting(
        "", help="py-spy binary; empty: PATH, then beside the agent's Python"
    )
    rendezvous_dir: str = setting(
        "", help="root-owned directory shared by all nodes' agents where each writes its "
                 "observations of an incident, so the batch host's agent can blame across "
                 "nodes; empty: blame from the batch host's own ranks only",
    )
    rendezvous_wait_s: float = setting(
        5.0, min=0, max=120, help="how long the batch host waits for the other nodes' reports"
    )
    exchange: ExchangeSection = setting(
        default_factory=ExchangeSection,
        help="network exchange of observations between a job's agents (munge, TCP)")
    incident_dir: str = setting(
        "", help="root-owned directory for incident reports kept by the agent; "
                 "empty: <node.state_dir>/incidents",
    )
    rendezvous: Literal["network", "directory", "none"] = setting(
        "network", help="how a job's agents exchange observations: network (munge-authenticated "
                        "TCP between agents), directory (rendezvous_dir), none (the batch host "
                        "sees only its own ranks)",
    )
    incident_deadline_s: float = setting(
        300.0, min=5, max=86400,
        help="how long an incident keeps retrying Slurm calls that fail (slurmctld down or "
             "slow), with backoff, before it gives up and says so",
    )
    node_loss_margin_s: float = setting(
        30.0, min=0, max=3600,
        help="when a launcher's step fails with no node of it out yet, how long past Slurm's "
             "SlurmdTimeout (twice this margin: pings) the batch host's agent waits for "
             "Slurm to mark a lost node before the launcher ends with the step's status",
    )
    node_unreachable_s: float = setting(
        5.0, min=0, max=3600,
        help="when a launcher's step fails, a step node whose slurmd and agent both refuse or "
             "time out a TCP connection from the batch host's agent for this long is taken "
             "as lost at once (relaunched without, never drained), instead of waiting for "
             "Slurm to mark it after SlurmdTimeout; 0: wait for Slurm only",
    )
    max_handled: int = setting(
        4096, min=16, max=1000000,
        help="incidents remembered on disk (newest kept), so a restarted agent never acts twice",
    )
    suspect_drain: bool = setting(
        True, help="take a node blamed only by heuristics (stalled first) out of service until "
                   "it passes verification (health gate plus loopback test), then return it; "
                   "false: only exclude it from the requeued job",
    )
    verify_loopback: bool = setting(
        True, help="the suspect verification runs the loopback all-reduce test of the nccl "
                   "section (with its backend, sizes and thresholds) besides the health gate",
    )
    verify_poll_s: float = setting(
        10.0, min=0.2, max=3600,
        help="how often an agent that took part in an incident looks for a suspect drain of "
             "its node (for verify_window_s after the incident)",
    )
    verify_window_s: float = setting(
        600.0, min=1, max=86400, help="how long after an incident the agent polls as above"
    )
    verify_calls_per_s: float = setting(
        10.0, min=0.1, max=10000,
        help="slurmctld calls per second the agents of one incident may make together while "
             "they poll as above: a job on more than verify_calls_per_s * verify_poll_s nodes "
             "polls every (its node count / verify_calls_per_s) seconds instead",
    )
    verify_idle_poll_s: float = setting(
        600.0, min=1, max=86400,
        help="how often an agent checks for a suspect drain of its node at other times "
             "(after a restart, or a drain set while it was down)",
    )
    suspect_threshold: int = setting(
        3, min=2, max=1000,
        help="suspicions of a node, from jobs of this many different users within "
             "suspect_window_s, call for a deeper verification (active diagnostics, a longer "
             "loopback test) and a report; only a failed check drains",
    )
    suspect_window_s: float = setting(
        86400.0, min=60, max=30 * 86400, help="window in which suspicions of a node add up"
    )
    budget_per_hour: int = setting(
        4, min=0, max=100000,
        help="suspects hang handling may take out of service per hour, cluster-wide (counted "
             "from the take-outs recorded in node Comments and our dated suspect reasons); "
             "past it suspects are reported, not drained; drains on evidence are not counted",
    )
    budget_per_user_per_hour: int = setting(
        2, min=0, max=100000,
        help="the same, per job owner, checked first: one user's jobs spend only this share"
    )
    no_requeue_policy: Literal["leave", "cancel"] = setting(
        "leave", help="a hung job submitted with --no-requeue: leave it running (reported) or "
                      "cancel it; its nodes are never drained for it",
    )
    max_report_bytes: int = setting(
        1 << 20, min=4096, max=64 << 20,
        help="largest report text `slurm-resilience report` returns through the agent socket",
    )

    @property
    def timeout_cap_s(self) -> float:
        """The longest step or warm-up timeout that still fires before NCCL's watchdog."""
        return self.nccl_timeout_s - self.nccl_margin_s

    def validate(self) -> None:
        cap = self.timeout_cap_s
        if cap <= 0:
            raise ValueError(f"nccl_margin_s={self.nccl_margin_s:g} must be below "
                             f"nccl_timeout_s={self.nccl_timeout_s:g}")
        for key in ("step_timeout_s", "warmup_timeout_s"):
            value = getattr(self, key)
            if value > cap:
                raise ValueError(
                    f"{key}={value:g} must stay below nccl_timeout_s - nccl_margin_s = {cap:g}, "
                    "or PyTorch kills the job before the evidence is captured"
                )
        if self.min_timeout_s > self.step_timeout_s:
            raise ValueError(f"min_timeout_s={self.min_timeout_s:g} is above "
                             f"step_timeout_s={self.step_timeout_s:g}")
        for name, value in self.section_timeouts_s.items():
            if not 0 < value <= 7 * 86400:
                raise ValueError(f"section_timeouts_s.{name}={value:g} must be in (0, 604800]")
