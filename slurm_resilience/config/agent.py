"""Settings of the per-node agent daemon (``slurm-resilience agent``)."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_resilience.config.loader import setting


@dataclass(frozen=True)
class AgentSection:
    """The node agent: one root daemon per node, hosting checkpoint sync and hang watching."""

    socket: str = setting(
        "/run/slurm-resilience/agent.sock",
        help="unix socket the agent listens on; jobs and hooks talk to it; may contain {node}",
    )
    tick_s: float = setting(1.0, min=0.05, max=60, help="how often the agent's loop wakes up")
    request_timeout_s: float = setting(
        5.0, min=0.1, max=300, help="longest a client waits for one answer from the agent"
    )
    max_request_bytes: int = setting(
        65536, min=1024, max=16 * 1024 * 1024, help="largest request line accepted from a client"
    )
    max_connections: int = setting(
        128, min=1, max=4096,
        help="connections served at once, all users together (root has 8 more of its own, so "
             "a user's flood can't shut out the hooks); one more is answered busy and closed",
    )
    max_connections_per_uid: int = setting(
        32, min=1, max=1024,
        help="connections one non-root uid may have open at once (a job's ranks, its CLI)",
    )
    newcomer_reserve: int = setting(
        16, min=0, max=4096,
        help="of max_connections, connections kept for users who have none open: a user "
             "with one open can't take these, so a few users' floods can't shut out another",
    )

    def validate(self) -> None:
        if self.newcomer_reserve >= self.max_connections:
            raise ValueError(f"newcomer_reserve={self.newcomer_reserve} must be below "
                             f"max_connections={self.max_connections}")
