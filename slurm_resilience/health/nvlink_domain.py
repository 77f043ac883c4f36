"""A node's NVLink domain, as its health gate last read it from NVML.

The gate saves it in the node's health state (``nvlink-domain.json``) whenever it changes;
``slurm-resilience topology generate --from-nvlink-domains`` reads every node's record and
groups the nodes into Slurm blocks (:mod:`slurm_resilience.topology.block`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from slurm_resilience.health.collectors.nvml_types import NvmlSnapshot

RECORD = "nvlink-domain"  # the health state's name for it (``nvlink-domain.json``)


@dataclass(frozen=True)
class GpuFabric:
    """One GPU's NVLink fabric as NVML reported it (nvmlGpuFabricInfo)."""

    index: int
    state: int
    status: int
    cluster_uuid: str | None = None
    clique_id: int | None = None
    health_mask: int | None = None
    health_summary: int | None = None


@dataclass
class NodeFabric:
    """What a node's health gate records: its GPUs' fabric, and when it read them."""

    node: str
    time: float
    gpus: list[GpuFabric] = field(default_factory=list)

    @classmethod
    def from_snapshot(cls, node: str, snap: NvmlSnapshot, now: float) -> NodeFabric:
        return cls(node, now, [
            GpuFabric(g.index, g.fabric.state, g.fabric.status, g.fabric.cluster_uuid,
                      g.fabric.clique_id, g.fabric.health_mask, g.fabric.health_summary)
            for g in snap.gpus if g.fabric is not None])

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeFabric:
        if not isinstance(data, dict) or not isinstance(data.get("node"), str):
            raise ValueError("not an NVLink domain record (no node name)")
        return cls(data["node"], float(data.get("time", 0)),
                   [GpuFabric(**g) for g in data.get("gpus", [])])

    def same_fabric(self, other: NodeFabric) -> bool:
        """Equal but for when it was read."""
        return (self.node, self.gpus) == (other.node, other.gpus)


MAX_RECORD_BYTES = 1 << 20


def read(path: str) -> NodeFabric | None:
    """The record at ``path``; None where there is none (no NVLink fabric, or the gate has
    not run). One that cannot be used raises ValueError naming the path."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(MAX_RECORD_BYTES + 1)
    try:
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
        return NodeFabric.from_json(json.loads(raw))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not an NVLink domain record: {exc}") from None


def path_for(health_state_dir: str) -> str:
    return os.path.join(health_state_dir, f"{RECORD}.json")
