"""Per-node path templates: a setting may hold ``{node}``, filled with the node's name.

On a real cluster each node has its own disk and paths need no template; in the
sandbox all nodes share one machine, so ``/state/nodes/{node}/nvme`` gives each
its own stand-in NVMe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def node_name(configured: str = "", env: Mapping[str, str] | None = None) -> str:
    """The Slurm node name, in the one order every process uses (hooks, agent, CLI):
    ``configured`` (a ``--node`` argument, else the config's ``node.name``), then
    ``SLURMD_NODENAME`` (from ``env``, default this process's), then the short host name.
    The agent runs without SLURMD_NODENAME, so a name set in the config must win for
    hooks too, or ``{node}`` paths (the agent's socket) would differ between them."""
    env = os.environ if env is None else env
    return configured or env.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]


def node_path(template: str, node: str) -> str:
    """Fill ``{node}`` in a path setting; a node name can never add a path separator."""
    if "/" in node or node in ("", ".", ".."):
        raise ValueError(f"node name {node!r} cannot be used in a path")
    return template.replace("{node}", node)
