"""The fabric model: leaves (placement units) with their nodes, and the switches above them.

Built from an ``ibnetdiscover`` capture (:func:`from_discovery`) or an existing
``topology.conf`` (:func:`from_switch_lines`). Everything downstream
(topology.conf, leaf features, the Lua data of job_submit.lua) is written from
a :class:`Fabric`, so both sources give the same outputs.

Naming is stable: a switch is named from its NodeDescription when that is a
specific, unique name (``MF0;A09-P1-IBLEAF-04-04:MQM9701/U1`` →
``A09-P1-IBLEAF-04-04``), otherwise from its GUID (``ibsw-2c5eab0300b87b40``);
discovery order never matters. A site map may rename any switch.

Multi-homed, rail-optimised nodes (DGX-style: 8 HCAs on 8 different leaves):
a tightly coupled job on such nodes stays "in one leaf" only if all its nodes
share the same *set* of leaves, because rail k of every node talks through
leaf k. So leaves that share a host are merged into one placement unit, a
**rail group** (connected components of the relation "some host has HCAs on
both leaves"), named ``rg-<first member leaf>`` unless the site map names it.
topology.conf lists the rail group as one leaf switch holding its nodes (a
node therefore never appears under two leaves, which slurmctld rejects), and
the leaf feature of such a node names its rail group. Single-homed nodes on a
leaf that belongs to a rail group join that group.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from slurm_resilience.config.topology import TopologySection
from slurm_resilience.slurm.parse import collect_hostlist
from slurm_resilience.topology.ibnetdiscover import Discovery, IbNode, norm_guid
from slurm_resilience.topology.links import DegradedLink, RatedLink, degraded

MAX_DEGRADED_LISTED = 10

MAX_SWITCH_NAME = 64
SWITCH_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# "MF0;A09-P1-IBLEAF-04-04:MQM9701/U1": managed NVIDIA/Mellanox switch, hostname between ; and :
_MF0 = re.compile(r"^[A-Z0-9]+;(?P<name>[^:;\s]+)(?::.*)?$")
# "Voltaire 4036 # hoibp0013": Voltaire switches append their hostname after " # ".
_VOLTAIRE = re.compile(r"^.*\s#\s+(?P<name>\S+)$")
# The second word of a host HCA's NodeDescription: "HCA-1", "mlx5_5", "hfi1_0", "ibp12s0".
_HCA_WORD = re.compile(r"^(HCA-?\d+|mlx\d+_\d+|hfi\d+_\d+|qib\d+|ib[a-z]?\w*\d+|irdma\d+)$")
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class SiteMap:
    """Site knowledge the fabric cannot tell: friendly switch names, hosts of HCAs.

    ``switches`` maps a switch GUID, its derived name, or a rail group's
    default name to the name to use; ``hosts`` maps an HCA GUID to its host
    (for HCAs still carrying a factory NodeDescription).
    """

    switches: Mapping[str, str] = field(default_factory=dict)
    hosts: Mapping[str, str] = field(default_factory=dict)

    def switch_name(self, *keys: str) -> str | None:
        for key in keys:
            if key in self.switches:
                return self.switches[key]
        return None

    def host_of(self, guid: str) -> str | None:
        return self.hosts.get(guid)


@dataclass(frozen=True)
class HcaReport:
    """An HCA left out of the compute fabric, with why."""

    guid: str
    description: str
    switch: str
    reason: str


@dataclass(frozen=True)
class Leaf:
    """A placement unit: one leaf switch, or a rail group of leaves sharing their nodes."""

    name: str
    nodes: tuple[str, ...]
    members: tuple[str, ...]

    @property
    def rail_group(self) -> bool:
        return len(self.members) > 1


@dataclass(frozen=True)
class UpperSwitch:
    """A switch above the leaves; ``children`` are leaf or switch names one level down."""

    name: str
    level: int
    children: tuple[str, ...]


@dataclass(frozen=True)
class Fabric:
    """Leaves with their nodes and the switches above them, plus what was left out."""

    leaves: tuple[Leaf, ...]
    uppers: tuple[UpperSwitch, ...] = ()
    unknown_hcas: tuple[HcaReport, ...] = ()
    storage_hcas: tuple[HcaReport, ...] = ()
    warnings: tuple[str, ...] = ()
    source: str = ""
    degraded_links: tuple[DegradedLink, ...] = ()

    def leaf_of(self) -> dict[str, str]:
        return {node: leaf.name for leaf in self.leaves for node in leaf.nodes}

    @property
    def nodes(self) -> list[str]:
        return sorted(n for leaf in self.leaves for n in leaf.nodes)

    def renamed(self, names: Mapping[str, str]) -> Fabric:
        """The fabric with hosts renamed (fabric hostname → Slurm NodeName)."""
        if not any(n in names for n in self.nodes):
            return self
        leaves = tuple(Leaf(lf.name, tuple(sorted(names.get(n, n) for n in lf.nodes)),
                            lf.members) for lf in self.leaves)
        return replace(self, leaves=leaves)

    def restricted_to(self, known: Iterable[str], *, why: str) -> Fabric:
        """The fabric without hosts outside ``known`` (e.g. slurm.conf); each drop is a warning."""
        keep = set(known)
        dropped = sorted(n for n in self.nodes if n not in keep)
        if not dropped:
            return self
        leaves = tuple(Leaf(lf.name, tuple(n for n in lf.nodes if n in keep), lf.members)
                       for lf in self.leaves)
        empty = {lf.name for lf in leaves if not lf.nodes}
        uppers = _prune(self.uppers, empty)
        note = (f"{len(dropped)} fabric host(s) left out, {why}: {collect_hostlist(dropped)}")
        return replace(self, leaves=tuple(lf for lf in leaves if lf.nodes), uppers=uppers,
                       warnings=(*self.warnings, note))


def _prune(uppers: tuple[UpperSwitch, ...], gone: set[str]) -> tuple[UpperSwitch, ...]:
    """Drop children that vanished, then switches left without children, bottom-up."""
    out: list[UpperSwitch] = []
    gone = set(gone)
    for sw in sorted(uppers, key=lambda s: s.level):
        children = tuple(c for c in sw.children if c not in gone)
        if children:
            out.append(UpperSwitch(sw.name, sw.level, children))
        else:
            gone.add(sw.name)
    return tuple(out)


# -- names ---------------------------------------------------------------------------------------

def derived_switch_name(description: str) -> str | None:
    """The name a switch description gives, or None if it is generic (model names, spaces)."""
    desc = description.strip()
    m = _MF0.match(desc) or _VOLTAIRE.match(desc)
    if m:
        desc = m.group("name")
    if not desc or not SWITCH_NAME.match(desc):
        return None
    return desc


def guid_switch_name(guid: str) -> str:
    return f"ibsw-{guid}"


def host_of_description(description: str) -> str | None:
    """``"a08-p1-dgx-04-c01 mlx5_5"`` → ``"a08-p1-dgx-04-c01"``; a bare hostname is itself."""
    words = description.split()
    if len(words) == 2 and _HCA_WORD.match(words[1]) and _HOST.match(words[0]):
        return words[0]
    if len(words) == 1 and _HOST.match(words[0]):
        return words[0]
    return None


class _Classifier:
    def __init__(self, cfg: TopologySection, site: SiteMap):
        self.site = site
        self.storage = [re.compile(p) for p in cfg.storage_hca_patterns]
        self.default = [re.compile(p) for p in cfg.default_description_patterns]
        self.infra = [re.compile(p) for p in cfg.infrastructure_patterns]
        self.service = [re.compile(p) for p in cfg.service_host_patterns]

    def classify(self, ca: IbNode) -> tuple[str, str]:
        """(``host``|``storage``|``infra``|``unknown``, host name or reason)."""
        mapped = self.site.host_of(ca.guid)
        if mapped:
            return "host", mapped
        desc = ca.description
        if any(p.search(desc) for p in self.infra):
            return "infra", "fabric infrastructure"
        if any(p.search(desc) for p in self.storage):
            return "storage", "storage HCA (matches storage_hca_patterns)"
        if not desc:
            return "unknown", "no NodeDescription in the capture"
        if any(p.search(desc) for p in self.default):
            return "unknown", "factory NodeDescription names no host"
        host = host_of_description(desc)
        if host is None:
            return "unknown", "NodeDescription is not '<host> <hca>'"
        if any(p.search(host) for p in self.service):
            return "storage", f"service host {host} (matches service_host_patterns)"
        return "host", host


def _switch_names(switches: list[IbNode], site: SiteMap) -> dict[str, str]:
    derived = {sw.guid: derived_switch_name(sw.description) for sw in switches}
    counts: dict[str, int] = defaultdict(int)
    for name in derived.values():
        if name:
            counts[name] += 1
    names: dict[str, str] = {}
    for sw in switches:
        own = derived[sw.guid]
        base = own if own and counts[own] == 1 else guid_switch_name(sw.guid)
        names[sw.guid] = site.switch_name(sw.guid, base) or base
    return names


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


# -- building --------------------------------------------------------------------------------------

def from_discovery(disc: Discovery, cfg: TopologySection, site: SiteMap | None = None,
                   source: str = "") -> Fabric:
    """Build the fabric model from a parsed ibnetdiscover capture."""
    site = site or SiteMap()
    switches = disc.of_kind("switch")
    names = _switch_names(switches, site)
    classifier = _Classifier(cfg, site)
    verdicts = {ca.guid: classifier.classify(ca) for ca in disc.of_kind("ca")}

    adjacency: dict[str, set[str]] = {names[sw.guid]: set() for sw in switches}
    host_leaves: dict[str, set[str]] = defaultdict(set)
    unknown: dict[str, HcaReport] = {}
    storage: dict[str, HcaReport] = {}
    linked: set[str] = set()
    for link in disc.links:
        a, b = disc.nodes[link.a], disc.nodes[link.b]
        if a.kind == "switch" and b.kind == "switch":
            if a.guid != b.guid:
                adjacency[names[a.guid]].add(names[b.guid])
                adjacency[names[b.guid]].add(names[a.guid])
            continue
        if {a.kind, b.kind} != {"switch", "ca"}:
            continue  # CA back-to-back or router links carry no leaf
        sw, ca = (a, b) if a.kind == "switch" else (b, a)
        linked.add(ca.guid)
        what, detail = verdicts[ca.guid]
        if what == "host":
            host_leaves[detail].add(names[sw.guid])
        elif what == "unknown":
            unknown[ca.guid] = HcaReport(ca.guid, ca.description, names[sw.guid], detail)
        elif what == "storage":
            storage[ca.guid] = HcaReport(ca.guid, ca.description, names[sw.guid], detail)
    for ca in disc.of_kind("ca"):
        what, detail = verdicts[ca.guid]
        if ca.guid not in linked and what in ("host", "unknown"):
            why = f"host {detail}: " if what == "host" else ""
            unknown[ca.guid] = HcaReport(ca.guid, ca.description, "",
                                         f"{why}no link to any switch in the capture")
    warnings: list[str] = []
    slow = _degraded_links(disc, names, verdicts)
    if slow:
        warnings.append(f"{len(slow)} link(s) run below their peers' width or speed")
        warnings.extend(str(d) for d in slow[:MAX_DEGRADED_LISTED])
        if len(slow) > MAX_DEGRADED_LISTED:
            warnings.append(f"... and {len(slow) - MAX_DEGRADED_LISTED} more degraded link(s)")
    if disc.skipped:
        first = ", ".join(str(n) for n, _ in disc.skipped[:5])
        warnings.append(f"{len(disc.skipped)} line(s) not understood and skipped (line {first}"
                        f"{', ...' if len(disc.skipped) > 5 else ''})")
    fabric = _assemble(host_leaves, adjacency, cfg, site, tuple(sorted(unknown.values(),
                       key=lambda r: (r.switch, r.description, r.guid))),
                       tuple(sorted(storage.values(), key=lambda r: (r.switch, r.guid))),
                       warnings, source)
    return replace(fabric, degraded_links=tuple(slow))


def _degraded_links(disc: Discovery, names: Mapping[str, str],
                    verdicts: Mapping[str, tuple[str, str]]) -> list[DegradedLink]:
    """Links whose rate the capture gives and that run below the others of their kind."""
    def end(node: IbNode) -> str:
        if node.kind == "switch":
            return names[node.guid]
        what, detail = verdicts.get(node.guid, ("", ""))
        return detail if what == "host" else (node.description or f"0x{node.guid}")

    rated: list[RatedLink] = []
    for link, rate in disc.rates.items():
        a, b = disc.nodes[link.a], disc.nodes[link.b]
        if a.guid == b.guid or "router" in (a.kind, b.kind):
            continue  # a switch's loopback cable says nothing about the fabric
        kind: Literal["switch", "host"] = (
            "switch" if a.kind == b.kind == "switch" else "host")
        if kind == "host" and b.kind == "switch":
            a, b = b, a  # name host links switch first
            rated.append(RatedLink(end(a), link.b_port, end(b), link.a_port, kind, rate))
        else:
            rated.append(RatedLink(end(a), link.a_port, end(b), link.b_port, kind, rate))
    return degraded(rated)


def _assemble(host_leaves: Mapping[str, set[str]], adjacency: Mapping[str, set[str]],
              cfg: TopologySection, site: SiteMap, unknown: tuple[HcaReport, ...],
              storage: tuple[HcaReport, ...], warnings: list[str], source: str) -> Fabric:
    uf = _UnionFind()
    for leaves in host_leaves.values():
        first, *rest = sorted(leaves)
        uf.find(first)
        for other in rest:
            uf.union(first, other)
    members: dict[str, list[str]] = defaultdict(list)
    for leaf in uf.parent:
        members[uf.find(leaf)].append(leaf)
    unit_name: dict[str, str] = {}
    for root, group in members.items():
        group.sort()
        if len(group) == 1:
            unit_name[root] = group[0]
        else:
            default = f"rg-{group[0]}"
            unit_name[root] = site.switch_name(default) or default
    unit_nodes: dict[str, list[str]] = defaultdict(list)
    for host, host_on in host_leaves.items():
        unit_nodes[unit_name[uf.find(min(host_on))]].append(host)
    leaf_units = {leaf: unit_name[uf.find(leaf)] for leaf in uf.parent}
    units = tuple(
        Leaf(unit_name[root], tuple(sorted(unit_nodes[unit_name[root]])), tuple(group))
        for root, group in sorted(members.items(), key=lambda kv: unit_name[kv[0]])
    )
    multi = [h for h, ls in host_leaves.items() if len(ls) > 1]
    if multi:
        groups = sum(1 for lf in units if lf.rail_group)
        warnings.append(f"{len(multi)} multi-homed host(s): their leaves form {groups} rail "
                        "group(s), each placed as one leaf")
    uppers, orphans = _levels(leaf_units, adjacency)
    if orphans:
        warnings.append(f"{len(orphans)} switch(es) reach no host and were left out: "
                        f"{', '.join(sorted(orphans)[:8])}{', ...' if len(orphans) > 8 else ''}")
    fabric = Fabric(units, tuple(uppers), unknown, storage, tuple(warnings), source)
    return add_root(fabric, cfg.root_switch)


def _levels(leaf_units: Mapping[str, str], adjacency: Mapping[str, set[str]]
            ) -> tuple[list[UpperSwitch], list[str]]:
    """Level of each non-leaf switch = hops to the nearest leaf; children are one level down."""
    level: dict[str, int] = dict.fromkeys(leaf_units, 0)
    frontier = list(leaf_units)
    depth = 0
    while frontier:
        depth += 1
        nxt: list[str] = []
        for sw in frontier:
            for peer in adjacency.get(sw, ()):
                if peer not in level:
                    level[peer] = depth
                    nxt.append(peer)
        frontier = nxt
    uppers: list[UpperSwitch] = []
    for sw, lvl in level.items():
        if lvl == 0:
            continue
        below = {p for p in adjacency[sw] if level.get(p) == lvl - 1}
        children = {leaf_units.get(p, p) for p in below}
        uppers.append(UpperSwitch(sw, lvl, tuple(sorted(children))))
    uppers.sort(key=lambda s: (s.level, s.name))
    orphans = [sw for sw in adjacency if sw not in level]
    return uppers, orphans


def add_root(fabric: Fabric, root_name: str) -> Fabric:
    """Add ``root_name`` above the top switches when no single switch reaches every node.

    Slurm's topology/tree can only place a job under one switch; without a
    common ancestor, a job larger than any subtree could never start.
    """
    if len(fabric.leaves) < 2:
        return fabric
    covered: dict[str, int] = {lf.name: len(lf.nodes) for lf in fabric.leaves}
    total = sum(covered.values())
    reach: dict[str, set[str]] = {lf.name: {lf.name} for lf in fabric.leaves}
    for sw in sorted(fabric.uppers, key=lambda s: s.level):
        reach[sw.name] = set().union(*(reach.get(c, set()) for c in sw.children))
    if any(sum(covered[lf] for lf in units) == total for units in reach.values()):
        return fabric
    children = {c for sw in fabric.uppers for c in sw.children}
    tops = sorted(name for name in reach if name not in children)
    top_level = max((sw.level for sw in fabric.uppers), default=0) + 1
    root = UpperSwitch(root_name, top_level, tuple(tops))
    note = (f"no switch reaches all {total} nodes: added {root_name} above "
            f"{len(tops)} top switch(es)")
    return replace(fabric, uppers=(*fabric.uppers, root), warnings=(*fabric.warnings, note))


@dataclass(frozen=True)
class SwitchLine:
    """One ``SwitchName=`` line of a topology.conf, as written (for checks and round trips)."""

    name: str
    nodes: tuple[str, ...] = ()
    switches: tuple[str, ...] = ()
    line: int = 0
    has_nodes: bool = False
    has_switches: bool = False


def from_switch_lines(lines: list[SwitchLine], source: str = "") -> Fabric:
    """A fabric from a topology.conf; call :func:`~.validate.check_lines` first."""
    leaves = tuple(sorted((Leaf(sl.name, tuple(sorted(sl.nodes)), (sl.name,))
                           for sl in lines if sl.nodes), key=lambda lf: lf.name))
    by_name = {sl.name: sl for sl in lines}
    level: dict[str, int] = {lf.name: 0 for lf in leaves}

    def level_of(name: str, seen: frozenset[str] = frozenset()) -> int:
        if name in level:
            return level[name]
        sl = by_name.get(name)
        if sl is None or name in seen or not sl.switches:
            return 0
        lvl = 1 + max(level_of(c, seen | {name}) for c in sl.switches)
        level[name] = lvl
        return lvl

    uppers = tuple(sorted((UpperSwitch(sl.name, level_of(sl.name), tuple(sl.switches))
                           for sl in lines if sl.switches and not sl.nodes),
                          key=lambda s: (s.level, s.name)))
    return Fabric(leaves, uppers, source=source)


def norm_site_guid(key: str) -> str:
    """A GUID key of the site map in the spelling the model uses, or the key unchanged."""
    text = key.strip()
    if re.fullmatch(r"(0x)?[0-9A-Fa-f]{1,16}", text) and (text.startswith("0x") or len(text) > 8):
        return norm_guid(text)
    return text
