"""NVLink domains → Slurm's block topology (GB200 NVL72 and other multi-node NVLink racks).

On a multi-node NVLink system the failure and placement domain is the NVLink partition
(an NVL72 rack: 18 trays of 4 GPUs), not the InfiniBand leaf. NVML names it on every GPU:
``nvmlGpuFabricInfo`` clusterUuid + cliqueId. Each node's health gate records its GPUs'
fabric (:class:`NodeFabric`, saved as ``nvlink-domain.json`` in the node's health state);
this module groups the nodes by that pair into blocks and writes what Slurm reads:

* Slurm 23.11 to 25.02: ``topology.conf`` with ``BlockName=... Nodes=...`` lines
  (``TopologyPlugin=topology/block``);
* Slurm 25.05 and later: ``topology.yaml`` with one ``block`` topology (topology.conf is
  ignored when topology.yaml exists);
* Slurm 23.02 and older (22.05 here) have no topology/block: refused with that reason; the
  tree from ibnetdiscover stays their topology.

A node is placed in a block only when every GPU registered (state COMPLETED, status
success) in one and the same domain. A node whose GPUs name two domains (split), that is in
none, or whose GPUs reported no fabric is left out and reported; a node whose fabric health
is degraded is placed in its block and reported (its health gate drains it, and a drained
node comes back to its block once repaired without regenerating the topology).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import yaml

from slurm_resilience.config.topology import TopologySection
from slurm_resilience.health.checks import gpu_fabric
from slurm_resilience.health.nvlink_domain import GpuFabric, NodeFabric
from slurm_resilience.slurm.parse import collect_hostlist
from slurm_resilience.topology import generate, model, validate
from slurm_resilience.topology.slurmconf import SlurmNodes

BLOCK_SINCE = (23, 11)  # topology/block
YAML_SINCE = (25, 5)  # topology.yaml
ZERO_UUID = "00000000-0000-0000-0000-000000000000"
_VERSION = re.compile(r"^(\d+)\.(\d+)")


@dataclass(frozen=True)
class Block:
    name: str
    cluster_uuid: str
    clique_id: int
    nodes: tuple[str, ...]


@dataclass
class Plan:
    """The blocks, the nodes left out (node → why) and warnings on placed nodes."""

    blocks: list[Block]
    left_out: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def block_size(self) -> int:
        """The base block size Slurm plans with: the smallest block (jobs of up to this many
        nodes fit in any block)."""
        return min((len(b.nodes) for b in self.blocks), default=0)


def _health(g: GpuFabric) -> str | None:
    """Why a registered GPU's fabric is not healthy, or None."""
    faults = gpu_fabric.mask_faults(g.health_mask or 0)
    summary = gpu_fabric.SUMMARY.get(g.health_summary or 0, str(g.health_summary))
    if faults or summary in ("UNHEALTHY", "LIMITED_CAPACITY"):
        detail = f": {', '.join(faults)}" if faults else ""
        return f"gpu{g.index} fabric health {summary}{detail} (mask 0x{g.health_mask or 0:x})"
    return None


def _domain(rec: NodeFabric) -> tuple[tuple[str, int] | None, str, list[str]]:
    """The node's domain (or None and why), and health warnings."""
    if not rec.gpus or all(g.state == gpu_fabric.FABRIC_NOT_SUPPORTED for g in rec.gpus):
        return None, "its GPUs report no NVLink fabric", []
    for g in rec.gpus:
        if g.state != gpu_fabric.FABRIC_COMPLETED or g.status != 0:
            state = gpu_fabric.FABRIC_STATES.get(g.state, str(g.state))
            status = gpu_fabric.STATUS_NAMES.get(g.status, str(g.status))
            return None, (f"gpu{g.index} fabric not registered (state {state}, status "
                          f"{'success' if g.status == 0 else status})"), []
    domains: dict[tuple[str, int], list[int]] = {}
    for g in rec.gpus:
        domains.setdefault((g.cluster_uuid or ZERO_UUID, g.clique_id or 0), []).append(g.index)
    if len(domains) > 1:
        parts = "; ".join(f"gpu{','.join(map(str, idx))} in clique {c} of {u}"
                          for (u, c), idx in sorted(domains.items(), key=lambda kv: kv[1]))
        return None, f"split over {len(domains)} NVLink domains: {parts}", []
    (dom,) = domains
    if dom[0] == ZERO_UUID:
        return None, "in no NVLink domain (cluster UUID all zeros)", []
    warnings = [w for w in (_health(g) for g in rec.gpus) if w]
    return dom, "", warnings


def block_name(cluster_uuid: str, clique_id: int) -> str:
    """Stable across runs and discovery order: the cluster UUID's first group and the clique."""
    return f"nvl-{cluster_uuid.split('-')[0]}-{clique_id}"


def plan(records: Iterable[NodeFabric], known: Sequence[str] | None = None) -> Plan:
    """Group nodes into blocks by (cluster UUID, clique id). ``known``: slurm.conf's nodes;
    any without a record is left out and named, records of unknown nodes are ignored with a
    warning."""
    by_node = {r.node: r for r in records}
    out = Plan([])
    members: dict[tuple[str, int], list[str]] = {}
    for node in sorted(by_node):
        if known is not None and node not in known:
            out.warnings.append(f"{node}: not in slurm.conf, ignored")
            continue
        dom, why, warnings = _domain(by_node[node])
        out.warnings += [f"{node}: {w}" for w in warnings]
        if dom is None:
            out.left_out[node] = why
        else:
            members.setdefault(dom, []).append(node)
    for node in known or []:
        if node not in by_node:
            out.left_out[node] = "no NVLink domain record (has its health check run?)"
    names: dict[str, tuple[str, int]] = {}
    for dom in members:
        name = block_name(*dom)
        if name in names:  # two clusters sharing their UUID's first group: use it all
            name = f"nvl-{dom[0]}-{dom[1]}"
        names[name] = dom
    # Adjacent blocks are aggregated by BlockSizes: keep racks in node-name order.
    out.blocks = sorted((Block(n, d[0], d[1], tuple(members[d])) for n, d in names.items()),
                        key=lambda b: b.nodes[0])
    return out


class VersionError(ValueError):
    """A Slurm without what the output needs."""


def parse_version(text: str) -> tuple[int, int]:
    m = _VERSION.match(text.strip())
    if not m:
        raise ValueError(f"not a Slurm version: {text!r} (expected e.g. 24.11)")
    return int(m.group(1)), int(m.group(2))


def output_for(version: tuple[int, int]) -> str:
    """The file Slurm ``version`` reads a block topology from."""
    if version < BLOCK_SINCE:
        raise VersionError(
            f"Slurm {version[0]}.{version[1]:02d} has no topology/block (it came in 23.11): "
            "keep its tree topology (topology generate --from-ibnetdiscover)")
    return "topology.yaml" if version >= YAML_SINCE else "topology.conf"


def topology_conf(p: Plan) -> str:
    lines = ["# Generated by `slurm-resilience topology generate --from-nvlink-domains`: one",
             "# block per NVLink domain (cluster UUID + clique id); TopologyPlugin=topology/block."]
    for b in p.blocks:
        lines.append(f"# {b.name}: clique {b.clique_id} of cluster {b.cluster_uuid}")
        lines.append(f"BlockName={b.name} Nodes={collect_hostlist(list(b.nodes))}")
    lines.append(f"BlockSizes={p.block_size}")
    return "\n".join(lines) + "\n"


def topology_yaml(p: Plan, name: str = "nvlink") -> str:
    doc = [{"topology": name, "cluster_default": True,
            "block": {"block_sizes": [p.block_size],
                      "blocks": [{"block": b.name, "nodes": collect_hostlist(list(b.nodes))}
                                 for b in p.blocks]}}]
    head = ("# Generated by `slurm-resilience topology generate --from-nvlink-domains`: one\n"
            "# block per NVLink domain (cluster UUID + clique id).\n")
    return head + yaml.safe_dump(doc, sort_keys=False)


def switch_lines(p: Plan) -> str:
    """The blocks as leaf switches (topology.conf tree syntax): the input of job_submit.lua's
    data, which pins a job to one block as it pins one to a leaf."""
    return "".join(f"SwitchName={b.name} Nodes={','.join(b.nodes)}\n" for b in p.blocks)


def lua_data(p: Plan, cfg: TopologySection, slurm: SlurmNodes | None) -> str:
    """job_submit.lua's data with the blocks as its leaves: a job that fits in a block is
    pinned to one (--switches=1, which topology/block reads as one block), as to one leaf.
    A larger job is left to Slurm's own block placement (and to the user's --segment, 24.05+):
    how to split it depends on the job's parallel layout, which only its owner knows."""
    lines = validate.parse_topology_conf(switch_lines(p))
    fabric = model.add_root(model.from_switch_lines(lines, source="NVLink domains"),
                            cfg.root_switch)
    tree_cfg = dataclasses.replace(cfg, mode="tree" if cfg.mode != "off" else "off",
                                   large_jobs="leave")
    return generate.lua_data(fabric, tree_cfg, slurm, unit="block")


def render(p: Plan, version: tuple[int, int]) -> tuple[str, str]:
    """(file name, text) for Slurm ``version``."""
    name = output_for(version)
    if not p.blocks:
        raise ValueError("no node is in an NVLink domain: no block to write")
    return name, topology_yaml(p) if name == "topology.yaml" else topology_conf(p)


def load_record(text: str) -> NodeFabric:
    return NodeFabric.from_json(json.loads(text))
