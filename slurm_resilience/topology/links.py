"""Link width and speed from a capture, and the links running below their peers.

ibnetdiscover prints each link's active rate: ``4xNDR`` at the end of a port line of
the topology format, ``4x EDR`` in the ports report. A link that trained down (a bad
cable or transceiver: ``4xDDR`` in an EDR fabric, ``2xNDR`` where its peers run
``4xNDR``) still carries traffic, so nothing else notices it.

Peers are the links of the same kind: switch-to-switch links are compared with the
other switch-to-switch links, host links with the other host links. The reference is
the most common width and the most common speed of the kind; a link below either is
degraded. A fabric that mixes generations on purpose (old DDR hosts on a QDR fabric)
shows its older links here too: the report is a warning, never an error.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

# Per-lane signalling rates (Gb/s) of the InfiniBand speed names, for ordering only.
SPEED_ORDER: dict[str, float] = {
    "SDR": 2.5, "DDR": 5.0, "QDR": 10.0, "FDR10": 10.3125, "FDR": 14.0625, "EDR": 25.78125,
    "HDR": 53.125, "NDR": 106.25, "XDR": 212.5,
}
_RATE = re.compile(r"(?P<width>\d+)x\s?(?P<speed>SDR|DDR|QDR|FDR10|FDR|EDR|HDR|NDR|XDR)\b")

LinkKind = Literal["switch", "host"]


@dataclass(frozen=True)
class LinkRate:
    """Active width (lanes) and speed of one link."""

    width: int
    speed: str

    def __str__(self) -> str:
        return f"{self.width}x{self.speed}"


def rate_at_end(text: str) -> LinkRate | None:
    """The last ``4xNDR`` / ``4x NDR`` in ``text`` (the link's rate ends a port line)."""
    found = list(_RATE.finditer(text))
    if not found:
        return None
    m = found[-1]
    return LinkRate(int(m["width"]), m["speed"])


@dataclass(frozen=True)
class RatedLink:
    """A link between two named ends, with its kind and rate."""

    a: str
    a_port: int
    b: str
    b_port: int
    kind: LinkKind
    rate: LinkRate


@dataclass(frozen=True)
class DegradedLink:
    """A link below its peers: ``rate`` against the ``expected`` most common one."""

    link: RatedLink
    expected: LinkRate

    def __str__(self) -> str:
        link = self.link
        what = "inter-switch link" if link.kind == "switch" else "host link"
        return (f"degraded {what} {link.a} port {link.a_port} - {link.b} port {link.b_port}: "
                f"{link.rate} (peers {self.expected})")


def _mode(values: Iterable[int | str]) -> int | str:
    counts = Counter(values)
    # Ties go to the faster value: being told about a slow link beats missing it.
    return max(counts, key=lambda v: (counts[v], SPEED_ORDER.get(str(v), v)))


def degraded(links: Iterable[RatedLink]) -> list[DegradedLink]:
    """The links whose width or speed is below the most common one of their kind."""
    by_kind: dict[LinkKind, list[RatedLink]] = {}
    for link in links:
        by_kind.setdefault(link.kind, []).append(link)
    out: list[DegradedLink] = []
    for group in by_kind.values():
        if len(group) < 2:
            continue  # a link alone has no peers to be measured against
        width = int(_mode(lk.rate.width for lk in group))
        speed = str(_mode(lk.rate.speed for lk in group))
        expected = LinkRate(width, speed)
        for lk in group:
            if lk.rate.width < width or SPEED_ORDER[lk.rate.speed] < SPEED_ORDER[speed]:
                out.append(DegradedLink(lk, expected))
    out.sort(key=lambda d: (d.link.kind != "switch", d.link.a, d.link.a_port))
    return out
