"""Whether a failed step's nodes can still be reached, without waiting for Slurm.

Slurm marks a dead node DOWN only after SlurmdTimeout of missed pings (300 s by default):
most of a node-loss recovery's time. The batch host's agent has better evidence sooner:
a node whose slurmd and agent both refuse or time out a TCP connection cannot run the
step's ranks. :func:`probe_nodes` gathers that (a connect to each node's slurmd port and
agent exchange port, side by side, each bounded); :class:`UnreachableSince` keeps, per
failed step, since when each node has answered neither, so that one lost probe is never
enough: a node counts as lost once it stayed unreachable through every probe for
``heartbeat.node_unreachable_s``. A lost node found this way is only left out of the
relaunched step; nothing here drains it (Slurm marks it itself).

Cost at 1,024 nodes: while one job's failed step is decided (seconds), at most one round a
second (``PROBE_EVERY_S``, however often its launcher polls), two connects per step node a
round, 64 at a time, each at most a second: about 2,000 connects a round on the batch host,
none to slurmctld.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurm_resilience.transport.reach import CONNECT_TIMEOUT_S, connect_errors

DEFAULT_SLURMD_PORT = 6818  # Slurm's, for a node whose Port Slurm doesn't show
# A round of probes at most this often per failed step: the launcher polls faster than this
# (to take an order within a fraction of a second), and a 1,024-node round is 2,000 connects.
PROBE_EVERY_S = 1.0


@dataclass(frozen=True)
class Target:
    """Where a step node's slurmd and agent listen."""

    node: str
    slurmd: tuple[str, int]
    agent: tuple[str, int]


@dataclass(frozen=True)
class Reach:
    """One probe of one node: '' for an endpoint that took the connection, else why not."""

    node: str
    slurmd: str
    agent: str

    @property
    def unreachable(self) -> bool:
        return bool(self.slurmd and self.agent)

    def describe(self, target: Target) -> str:
        return (f"slurmd {target.slurmd[0]}:{target.slurmd[1]} {self.slurmd or 'answers'}, "
                f"agent {target.agent[0]}:{target.agent[1]} {self.agent or 'answers'}")


def probe_nodes(targets: Sequence[Target], timeout_s: float = CONNECT_TIMEOUT_S
                ) -> dict[str, Reach]:
    """Probe every target's slurmd and agent (transport.reach: 64 connects at a time)."""
    errors = connect_errors([a for t in targets for a in (t.slurmd, t.agent)], timeout_s)
    return {t.node: Reach(t.node, errors[2 * i], errors[2 * i + 1])
            for i, t in enumerate(targets)}


class UnreachableSince:
    """Per failed step: since when each node has been unreachable in every probe."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}
        self.probed_at: float | None = None
        self.last: Mapping[str, Reach] = {}

    def due(self, now: float) -> bool:
        """Whether a new round of probes is due (the first at once, then one a
        ``PROBE_EVERY_S``)."""
        return self.probed_at is None or now - self.probed_at >= PROBE_EVERY_S

    def update(self, probes: Mapping[str, Reach], now: float) -> None:
        self.probed_at, self.last = now, dict(probes)
        for node, reach in probes.items():
            if reach.unreachable:
                self.since.setdefault(node, now)
            else:
                self.since.pop(node, None)  # it answered: any earlier miss counts for nothing

    def lost(self, now: float, after_s: float) -> dict[str, float]:
        """Nodes unreachable for at least ``after_s`` → for how long."""
        return {n: now - t for n, t in sorted(self.since.items()) if now - t >= after_s}
