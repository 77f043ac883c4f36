"""Read what topology generation needs from slurm.conf: node names, features, partitions.

Only ``NodeName=`` and ``PartitionName=`` lines are read (``Include`` lines
are followed relative to the file). Values are hostlist expressions; keys are
case-insensitive, as in Slurm.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

from slurm_resilience.slurm.parse import expand_hostlist


@dataclass
class SlurmNodes:
    """Nodes and partitions defined by a slurm.conf."""

    nodes: dict[str, dict[str, str]] = field(default_factory=dict)
    partitions: dict[str, list[str]] = field(default_factory=dict)
    default_partition: str = ""

    def node_names_for(self, hosts: list[str]) -> dict[str, str]:
        """Fabric hostnames that are not NodeNames but name one: by NodeHostname, or by the
        short form of a fully qualified name (``gpu001.cluster`` → ``gpu001``)."""
        by_hostname: dict[str, str] = {}
        for name, fields in self.nodes.items():
            hostname = fields.get("nodehostname", "")
            if hostname:
                by_hostname.setdefault(hostname, name)
                by_hostname.setdefault(hostname.split(".")[0], name)
        out: dict[str, str] = {}
        for host in hosts:
            if host in self.nodes:
                continue
            short = host.split(".")[0]
            match = by_hostname.get(host) or by_hostname.get(short) or (
                short if short in self.nodes else None)
            if match:
                out[host] = match
        return out

    def features(self, node: str) -> list[str]:
        text = self.nodes.get(node, {}).get("features", "")
        return [f for f in text.split(",") if f]


def _fields(line: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for word in shlex.split(line, comments=False, posix=True):
        key, sep, value = word.partition("=")
        if sep:
            out[key.lower()] = value
    return out


def _lines(path: str, depth: int = 0) -> list[str]:
    if depth > 8:
        raise ValueError(f"topology: slurm.conf: couldn't read {path}: Include nested too deep")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if not line:
            continue
        first, _, rest = line.partition(" ")
        if first.lower() == "include" and rest.strip():
            target = rest.strip()
            if not os.path.isabs(target):
                target = os.path.join(os.path.dirname(path), target)
            out.extend(_lines(target, depth + 1))
            continue
        out.append(line)
    return out


def parse_slurm_conf(path: str) -> SlurmNodes:
    """The nodes (with their attributes) and partitions of ``path``."""
    conf = SlurmNodes()
    defaults: dict[str, str] = {}
    partition_lines: list[dict[str, str]] = []
    for line in _lines(path):
        key = line.split("=", 1)[0].strip().lower()
        if key == "nodename":
            fields = _fields(line)
            names = fields.pop("nodename")
            if names.upper() == "DEFAULT":
                defaults.update(fields)
                continue
            for node in expand_hostlist(names):
                conf.nodes[node] = {**defaults, **fields}
        elif key == "partitionname":
            partition_lines.append(_fields(line))
    for fields in partition_lines:
        name = fields.get("partitionname", "")
        if not name or name.upper() == "DEFAULT":
            continue
        spec = fields.get("nodes", "")
        members: list[str] = []
        for part in _split_top(spec):
            members.extend(sorted(conf.nodes) if part.upper() == "ALL" else expand_hostlist(part))
        conf.partitions[name] = members
        if fields.get("default", "").upper() == "YES":
            conf.default_partition = name
    return conf


def _split_top(spec: str) -> list[str]:
    """Split a node list on the commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return [p for p in out if p]
