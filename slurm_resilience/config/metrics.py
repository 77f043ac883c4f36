"""Settings of the agent's Prometheus metrics and of straggler naming."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_resilience.config.loader import setting


@dataclass(frozen=True)
class MetricsSection:
    """Prometheus metrics served by every node agent (``slurm_resilience_*``)."""

    listen_address: str = setting(
        "127.0.0.1",
        help="address the agent's /metrics endpoint binds; loopback by default (set the "
             "node's management address, or 0.0.0.0, for a Prometheus server elsewhere)",
    )
    port: int = setting(9814, min=0, max=65535,
                        help="TCP port of /metrics; 0: no HTTP endpoint")
    ports: dict[str, int] = setting(
        default_factory=dict,
        help="per-node port overriding `port` (node name -> port), for several agents on "
             "one host (the sandbox)")
    textfile: str = setting(
        "", help="also write the metrics to this file (node_exporter's textfile collector "
                 "directory, file name ending .prom), replaced atomically; may contain {node}; "
                 "empty: no file")
    textfile_interval_s: float = setting(15.0, min=1, max=3600,
                                         help="how often the textfile is rewritten")

    def port_of(self, node: str) -> int:
        return self.ports.get(node, self.port)

    def validate(self) -> None:
        for node, port in self.ports.items():
            if not 0 <= port <= 65535:
                raise ValueError(f"ports.{node}={port} is not a TCP port")


@dataclass(frozen=True)
class StragglerSection:
    """Naming ranks (each node's agent, among the node's ranks) and nodes (the job's first
    node's agent, among the job's nodes) persistently slower than the rest of their job,
    from heartbeat step times."""

    window_steps: int = setting(
        100, min=10, max=10000, help="recent step times kept per rank; medians are over these")
    min_steps: int = setting(
        50, min=5, max=10000, help="steps a rank (or node) needs in its window before it is "
                                   "judged")
    min_slowdown: float = setting(
        0.10, min=0.01, max=10,
        help="a straggler's median step time is at least this much above its job's median "
             "(0.10: 10% slower)")
    mad_threshold: float = setting(
        6.0, min=1, max=100,
        help="and this many robust standard deviations (1.4826 x MAD of the members' "
             "medians) above it")
    persist_evaluations: int = setting(
        10, min=1, max=10000,
        help="consecutive judgements (one per new step) a member must be slow in before it "
             "is named")
    suspect_after_jobs: int = setting(
        0, min=0, max=1000,
        help="make this node a suspect for verification (the hang handling's suspect path, "
             "within its hourly budgets) once it was named a straggler in this many different "
             "jobs, of at least 2 different users, within record_window_s; 0: never, only "
             "report; 1 is refused (one job is its owner's word only)")
    node_interval_s: float = setting(
        30.0, min=0, max=3600,
        help="how often each agent sends its summary of each multi-node job (median step "
             "time, steps, ranks) towards the job's judging agent (its first node), over the "
             "agents' exchange (heartbeat.exchange; its own listener on that port in "
             "rendezvous directory mode, none in mode none), and the judge judges the job's "
             "nodes; a node is named after persist_evaluations such judgements; 0: nodes are "
             "not judged")
    record_window_s: float = setting(
        7 * 86400.0, min=3600, max=365 * 86400,
        help="how long this node remembers the jobs it was a straggler in")

    def validate(self) -> None:
        if 0 < self.node_interval_s < 1:
            raise ValueError("node_interval_s must be 0 (off) or at least 1 s")
        if self.suspect_after_jobs == 1:
            raise ValueError("suspect_after_jobs=1 would let one job's owner take the node out "
                             "of service; use 0 (off) or at least 2 (jobs of 2 or more users)")
