"""Per-node path templates: a setting may hold ``{node}``, filled with the node's name.

On a real cluster each node has its own disk and paths need no template; in the
sandbox all nodes share one machine, so ``/state/nodes/{node}/nvme`` gives each
its own stand-in NVMe.
"""

from __future__ import annotations

import os
import socket


def node_name(configured: str = "") -> str:
    """The Slurm node name of this process: config, then SLURMD_NODENAME, then the host."""
    return configured or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def node_path(template: str, node: str) -> str:
    """Fill ``{node}`` in a path setting; a node name can never add a path separator."""
    if "/" in node or node in ("", ".", ".."):
        raise ValueError(f"node name {node!r} cannot be used in a path")
    return template.replace("{node}", node)
