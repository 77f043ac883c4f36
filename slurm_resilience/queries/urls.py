"""Where each node's agent answers: its metrics endpoint, at the node's address in Slurm."""

from __future__ import annotations

from slurm_resilience.config import Config
from slurm_resilience.slurm.adapter import from_config
from slurm_resilience.slurm.errors import SlurmError


def agent_urls(cfg: Config, nodes: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """``http://addr:port`` per node (one ``scontrol show node`` for all), and the nodes
    that have none, with why."""
    m = cfg.metrics
    try:
        addresses = from_config(cfg).node_addresses(nodes)
    except SlurmError as exc:
        return {}, dict.fromkeys(nodes, f"couldn't ask Slurm for its address: {exc}")
    urls, unknown = {}, {}
    for node in nodes:
        port, addr = m.port_of(node), addresses.get(node)
        if not port:
            unknown[node] = "its agent serves no metrics endpoint (metrics.port: 0)"
        elif addr is None:
            unknown[node] = "Slurm does not know the node any more"
        else:
            urls[node] = f"http://{f'[{addr}]' if ':' in addr else addr}:{port}"
    return urls, unknown
