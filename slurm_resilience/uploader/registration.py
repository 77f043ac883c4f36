"""The agent's checks of what a job's ``ckpt.register`` request carries (a user sends it)."""

from __future__ import annotations

from slurm_resilience.agent.service import RequestError
from slurm_resilience.checkpoint.agent_link import MAX_NODE_NAMES


def node_names(raw: object) -> list[str]:
    """The agent's check of a ``ckpt.register``'s ``unreachable_nodes`` (a user sends it):
    a bounded list of plain node names, sorted, without repeats."""
    if not isinstance(raw, list) or len(raw) > MAX_NODE_NAMES or not all(
            isinstance(n, str) and 0 < len(n) <= 64 and n.isprintable() and " " not in n
            for n in raw):
        raise RequestError(f"unreachable_nodes must be a list of at most {MAX_NODE_NAMES} "
                           "node names")
    return sorted(set(raw))
