"""Check a topology (parsed or generated) for what slurmctld would reject or mis-place.

Errors are what makes slurmctld refuse the file or misbehave. Observed with
slurmctld 22.05.8: a line with both ``Nodes=`` and ``Switches=`` is fatal
("has both child switches and nodes"), so is an undefined child switch ("has
invalid child"); a node under two leaves only logs "Multiple leaf switches
contain nodes" and leaves placement undefined; nodes slurm.conf lacks are
dropped with "Invalid hostnames in switch configuration". Also refused: a line
with no children, duplicated or malformed switch names, and names over 64
characters (22.05 accepts them, but they are this project's limit: they end up
in feature names, logs and sinfo columns). Warnings are legal but worth
knowing: slurm.conf nodes under no leaf, or no switch reaching every node.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from slurm_resilience.slurm.parse import collect_hostlist, expand_hostlist
from slurm_resilience.topology.model import MAX_SWITCH_NAME, SWITCH_NAME, Fabric, SwitchLine


@dataclass(frozen=True)
class Finding:
    """One problem; ``error`` ones stop generation."""

    error: bool
    where: str
    message: str

    def __str__(self) -> str:
        kind = "error" if self.error else "warning"
        return f"{kind}: {self.where}: {self.message}"


class TopologyError(Exception):
    """Generation refused: the findings say why."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        errors = [f for f in findings if f.error]
        super().__init__("; ".join(str(f) for f in errors))


def parse_topology_conf(text: str) -> list[SwitchLine]:
    """The ``SwitchName=`` lines of a topology.conf (keys case-insensitive, ``#`` comments)."""
    out: list[SwitchLine] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].rstrip()
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if not line:
            continue
        fields: dict[str, str] = {}
        for word in line.split():
            key, _, value = word.partition("=")
            fields[key.lower()] = value
        if "switchname" not in fields:
            raise ValueError(f"topology: topology.conf:{start}: couldn't parse line: expected "
                             f"SwitchName=..., got {line[:60]!r}")
        nodes = tuple(expand_hostlist(fields["nodes"])) if "nodes" in fields else ()
        switches = tuple(expand_hostlist(fields["switches"])) if "switches" in fields else ()
        out.append(SwitchLine(fields["switchname"], nodes, switches, start,
                              "nodes" in fields, "switches" in fields))
    return out


def check_lines(lines: list[SwitchLine], known_nodes: Iterable[str] | None = None
                ) -> list[Finding]:
    """Every finding for these switch lines; ``known_nodes`` are slurm.conf's nodes."""
    findings: list[Finding] = []
    seen: dict[str, int] = {}
    leaf_of: dict[str, list[str]] = defaultdict(list)
    for sl in lines:
        where = f"line {sl.line} SwitchName={sl.name}" if sl.line else f"SwitchName={sl.name}"
        if len(sl.name) > MAX_SWITCH_NAME:
            findings.append(Finding(True, where, f"switch name is {len(sl.name)} characters, "
                                                 f"more than the {MAX_SWITCH_NAME} allowed"))
        if not SWITCH_NAME.match(sl.name):
            findings.append(Finding(True, where, "switch name may hold only letters, digits, "
                                                 "'_', '.' and '-'"))
        if sl.name in seen:
            findings.append(Finding(True, where, f"switch defined twice (first at line "
                                                 f"{seen[sl.name]})"))
        seen.setdefault(sl.name, sl.line)
        if sl.has_nodes and sl.has_switches:
            findings.append(Finding(True, where, "has both Nodes= and Switches=; slurmctld "
                                                 "refuses to start ('has both child switches "
                                                 "and nodes')"))
        elif not sl.nodes and not sl.switches:
            findings.append(Finding(True, where, "has no Nodes= and no Switches= (no children)"))
        for node in sl.nodes:
            leaf_of[node].append(sl.name)
    names = {sl.name for sl in lines}
    for sl in lines:
        missing = [c for c in sl.switches if c not in names]
        if missing:
            findings.append(Finding(True, f"SwitchName={sl.name}",
                                    f"child switch(es) not defined: {', '.join(missing)} "
                                    "(slurmctld refuses to start: 'has invalid child')"))
    for node, leaves in sorted(leaf_of.items()):
        if len(leaves) > 1:
            findings.append(Finding(True, f"node {node}", f"is on {len(leaves)} leaves "
                                    f"({', '.join(leaves)}); a node belongs to one leaf switch "
                                    "(slurmctld only warns 'Multiple leaf switches contain "
                                    "nodes'; multi-homed nodes: use their rail group)"))
    if known_nodes is not None:
        known = set(known_nodes)
        unknown = sorted(n for n in leaf_of if n not in known)
        if unknown:
            findings.append(Finding(True, "Nodes=", f"{len(unknown)} node(s) unknown to "
                                    "slurm.conf (slurmctld drops them: 'Invalid hostnames in "
                                    f"switch configuration'): {collect_hostlist(unknown)}"))
        orphans = sorted(n for n in known if n not in leaf_of)
        if orphans:
            findings.append(Finding(False, "slurm.conf", f"{len(orphans)} node(s) under no leaf "
                                    "switch (no multi-node job can use them with "
                                    f"topology/tree): {collect_hostlist(orphans)}"))
    return findings


def switch_lines(fabric: Fabric) -> list[SwitchLine]:
    """The switch lines a fabric turns into, in topology.conf order."""
    out = [SwitchLine(lf.name, lf.nodes, (), 0, True, False) for lf in fabric.leaves]
    out += [SwitchLine(sw.name, (), sw.children, 0, False, True) for sw in fabric.uppers]
    return out


def check_fabric(fabric: Fabric, known_nodes: Iterable[str] | None = None) -> list[Finding]:
    """Findings for a model about to be written, its own warnings included."""
    findings = check_lines(switch_lines(fabric), known_nodes)
    if not fabric.leaves:
        findings.append(Finding(True, fabric.source or "fabric",
                                "no leaf switch with a compute host found (was ibnetdiscover "
                                "run on an isolated node, or are all hosts unknown?)"))
    findings += [Finding(False, fabric.source or "fabric", w) for w in fabric.warnings]
    return findings
