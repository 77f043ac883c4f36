"""Parse ``ibnetdiscover`` output into nodes (switches, CAs) and links.

Two formats are read, told apart line by line:

* the default topology file: stanzas that start with ``Switch N "S-<guid>" # "desc"``
  or ``Ca N "H-<guid>" # "desc"``, followed by one line per connected port,
  ``[port] "S-|H-<peer guid>"[peer port] # "peer desc" ...``;
* the ports report of ``ibnetdiscover -p``: one line per port,
  ``SW lid port 0x<guid> 4x EDR - CA lid port 0x<guid> ( 'desc' - 'peer desc' )``.

Anything else (vendid=/devid= lines, comments, ``Non-Chassis Nodes``, stderr
noise such as ``src/query_smp.c:195; umad ... bad status 110``) is skipped and
counted, never fatal: a capture taken on a busy fabric always has some. The
description of a peer is taken from the port line, so a capture whose CA
stanzas were cut still names every host a switch port leads to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from slurm_resilience.topology.links import LinkRate, rate_at_end

Kind = Literal["switch", "ca", "router"]

_KIND_OF_PREFIX: dict[str, Kind] = {"S": "switch", "H": "ca", "R": "router"}
_KIND_OF_WORD: dict[str, Kind] = {"switch": "switch", "ca": "ca", "rt": "router"}
_KIND_OF_P: dict[str, Kind] = {"SW": "switch", "CA": "ca", "RT": "router"}

# Switch 65 "S-2c5eab0300b87b40"   # "MF0;A09-P1-IBLEAF-04-04:MQM9701/U1" enhanced port 0 lid 73
_STANZA = re.compile(
    r'^(?P<word>Switch|Ca|Rt)\s+(?P<ports>\d+)\s+"(?P<kind>[SHR])-(?P<guid>[0-9A-Fa-f]+)"'
    r'(?P<rest>.*)$'
)
# [1]  "H-e09d7303007a4bd8"[1](e09d7303007a4bd8)   # "a08-p1-dgx-04-c01 mlx5_5" lid 647 4xNDR
# [2](3ba000100e38a)  "S-0021283a8389a0a0"[23] # lid 14 lmc 0 "Sun DCS 36 ..." lid 15 4xQDR
_PORT = re.compile(
    r'^\[(?P<port>\d+)\](?:\([0-9A-Fa-f]+\))?\s*"(?P<kind>[SHR])-(?P<guid>[0-9A-Fa-f]+)"'
    r'\[(?P<peer_port>\d+)\](?P<rest>.*)$'
)
# CA 78 1 0x946dae0300630bfe 4x HDR - SW 51 81 0x946dae0300630bf6 ( 'a' - 'b' )
_P_LINK = re.compile(
    r"^(?P<kind>SW|CA|RT)\s+(?P<lid>\d+)\s+(?P<port>\d+)\s+0x(?P<guid>[0-9A-Fa-f]+)\s+"
    r"(?P<width>\S+)\s+(?P<speed>\S+)\s+-\s+"
    r"(?P<pkind>SW|CA|RT)\s+(?P<plid>\d+)\s+(?P<pport>\d+)\s+0x(?P<pguid>[0-9A-Fa-f]+)\s+"
    r"\(\s*'(?P<desc>.*)'\s+-\s+'(?P<pdesc>.*)'\s*\)\s*$"
)
# SW 24 1 0x946dae0300618c82 4x SDR      '5FB0406-spine-IB01 '   (a port with no link)
_P_UNLINKED = re.compile(
    r"^(?P<kind>SW|CA|RT)\s+(?P<lid>\d+)\s+(?P<port>\d+)\s+0x(?P<guid>[0-9A-Fa-f]+)\s+"
    r"(?P<width>\S+)\s+(?P<speed>\S+)\s+'(?P<desc>.*)'\s*$"
)
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_IGNORED = re.compile(
    r"^(#.*|vendid=.*|devid=.*|sysimgguid=.*|switchguid=.*|caguid=.*|rtguid=.*|"
    r"Non-Chassis Nodes|Chassis .*|.*Chassis \d+.*)$"
)


class ParseError(ValueError):
    """The text holds no ibnetdiscover topology at all."""


def norm_guid(text: str) -> str:
    """``0x2c90300`` / ``0002C90300`` → ``0000000002c90300``: one spelling for every GUID."""
    return text.lower().removeprefix("0x").rjust(16, "0")


@dataclass
class IbNode:
    """A switch, CA or router as discovered; ``description`` is its NodeDescription."""

    guid: str
    kind: Kind
    description: str = ""


@dataclass(frozen=True)
class IbLink:
    """One cable: (guid, port) to (guid, port), stored with the smaller end first."""

    a: str
    a_port: int
    b: str
    b_port: int


@dataclass
class Discovery:
    """Everything a capture says: nodes by GUID, links, and the lines we skipped."""

    nodes: dict[str, IbNode] = field(default_factory=dict)
    links: set[IbLink] = field(default_factory=set)
    rates: dict[IbLink, LinkRate] = field(default_factory=dict)  # where the capture says
    skipped: list[tuple[int, str]] = field(default_factory=list)
    format: str = "topology"

    def add_node(self, guid: str, kind: Kind, description: str | None) -> IbNode:
        node = self.nodes.get(guid)
        if node is None:
            node = self.nodes[guid] = IbNode(guid, kind, "")
        if description is not None and not node.description:
            node.description = description
        return node

    def add_link(self, a: str, a_port: int, b: str, b_port: int,
                 rate: LinkRate | None = None) -> None:
        if (b, b_port) < (a, a_port):
            a, a_port, b, b_port = b, b_port, a, a_port
        link = IbLink(a, a_port, b, b_port)
        self.links.add(link)
        if rate is not None:
            self.rates[link] = rate

    def of_kind(self, kind: Kind) -> list[IbNode]:
        return [n for n in self.nodes.values() if n.kind == kind]


def clean_description(text: str) -> str:
    """Strip the padding some firmware leaves in NodeDescriptions (``' 5FB0406-spine-IB03 '``)."""
    return " ".join(text.split())


def _first_quoted(rest: str) -> str | None:
    """The first "quoted" string after the ``#`` of a line: a node's or a peer's description."""
    hash_at = rest.find("#")
    if hash_at < 0:
        return None
    m = _QUOTED.search(rest, hash_at)
    return clean_description(m.group(1)) if m else None


def parse(text: str) -> Discovery:
    """Parse a whole capture (either format). Raises :class:`ParseError` if nothing is found."""
    disc = Discovery()
    current: IbNode | None = None
    p_lines = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            current = None
            continue
        m = _STANZA.match(line)
        if m:
            kind = _KIND_OF_WORD[m.group("word").lower()]
            current = disc.add_node(norm_guid(m.group("guid")), kind, _first_quoted(m["rest"]))
            continue
        m = _PORT.match(line)
        if m and current is not None:
            peer = disc.add_node(norm_guid(m.group("guid")), _KIND_OF_PREFIX[m.group("kind")],
                                 _first_quoted(m["rest"]))
            disc.add_link(current.guid, int(m["port"]), peer.guid, int(m["peer_port"]),
                          rate_at_end(m["rest"]))
            continue
        m = _P_LINK.match(line)
        if m:
            p_lines += 1
            a = disc.add_node(norm_guid(m["guid"]), _KIND_OF_P[m["kind"]],
                              clean_description(m["desc"]))
            b = disc.add_node(norm_guid(m["pguid"]), _KIND_OF_P[m["pkind"]],
                              clean_description(m["pdesc"]))
            disc.add_link(a.guid, int(m["port"]), b.guid, int(m["pport"]),
                          rate_at_end(f"{m['width']}{m['speed']}"))
            continue
        m = _P_UNLINKED.match(line)
        if m:
            p_lines += 1
            disc.add_node(norm_guid(m["guid"]), _KIND_OF_P[m["kind"]],
                          clean_description(m["desc"]))
            continue
        if not _IGNORED.match(line):
            disc.skipped.append((number, raw))
    if not disc.nodes:
        raise ParseError("no Switch/Ca stanza and no ibnetdiscover -p port line found")
    disc.format = "ports" if p_lines else "topology"
    return disc
