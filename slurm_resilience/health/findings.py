"""What a check reports: a severity, the thing concerned, and actual against expected."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar


class Severity(enum.IntEnum):
    """Ordered so the worst finding wins: ok < warn < unknown < fail.

    ``unknown`` means "could not check"; the verdict's per-check policy decides
    whether it takes the node out (fail-closed) or is only reported (fail-open).
    """

    OK = 0
    WARN = 1
    UNKNOWN = 2
    FAIL = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Finding:
    """One observation. ``message`` is short enough to be a drain reason:
    ``gpu3 XID 79 (GPU fell off the bus) 12:01:07``."""

    check: str
    subject: str
    severity: Severity
    message: str
    data: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def reason(self) -> str:
        """The message, with the GPU's PCI address and serial when the finding is about one
        (``gpu3 XID 79 ... [0000:5D:00.0 sn 1650124031595]``): what an RMA desk acts on."""
        named = describe_identity(self.data, with_index=False)
        return f"{self.message} [{named}]" if named else self.message

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "subject": self.subject, "severity": self.severity.label,
                "message": self.message, "data": self.data}


S = TypeVar("S")


@dataclass(frozen=True)
class CheckResult(Generic[S]):
    """A check's findings plus the state to keep for its next run (counter baselines,
    Xid events already seen, streaks): the check's own typed record."""

    findings: list[Finding]
    state: S


def ok(check: str, subject: str, message: str, **data: Any) -> Finding:
    return Finding(check, subject, Severity.OK, message, data)


def warn(check: str, subject: str, message: str, **data: Any) -> Finding:
    return Finding(check, subject, Severity.WARN, message, data)


def fail(check: str, subject: str, message: str, **data: Any) -> Finding:
    return Finding(check, subject, Severity.FAIL, message, data)


def unknown(check: str, subject: str, message: str, **data: Any) -> Finding:
    return Finding(check, subject, Severity.UNKNOWN, message, data)


def human_size(n: int) -> str:
    """``53687091200`` → ``50.0GiB``, for messages."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def describe_identity(d: dict[str, Any], with_index: bool = True) -> str:
    """``gpu5 0000:9A:00.0 sn 1650124031597`` from an identity record; empty without one."""
    parts = [f"gpu{d['index']}"] if with_index and isinstance(d.get("index"), int) else []
    if d.get("pci_bus_id"):
        parts.append(short_bus_id(str(d["pci_bus_id"])))
    if d.get("serial"):
        parts.append(f"sn {d['serial']}")
    return " ".join(parts) if (d.get("pci_bus_id") or d.get("serial")) else ""


def short_bus_id(bus_id: str) -> str:
    """NVML's 8-digit domain as lspci shows it: ``00000000:9A:00.0`` → ``0000:9A:00.0``."""
    dom, sep, rest = bus_id.partition(":")
    return f"{int(dom, 16):04X}:{rest}" if sep and len(dom) == 8 else bus_id


_GPU_SUBJECT = re.compile(r"gpu(\d+)")


def with_gpu_identity(findings: list[Finding], identities: Mapping[int, Mapping[str, Any]]
                      ) -> list[Finding]:
    """Each finding about ``gpuN`` carries that GPU's PCI address and serial in its data
    (the event and ``status`` show them, the drain reason ends with them)."""
    out = []
    for f in findings:
        m = _GPU_SUBJECT.fullmatch(f.subject)
        ident = identities.get(int(m.group(1))) if m else None
        if ident and f.severity is not Severity.OK and "pci_bus_id" not in f.data:
            f = dataclasses.replace(f, data={**f.data, "pci_bus_id": ident.get("pci_bus_id"),
                                             "serial": ident.get("serial")})
        out.append(f)
    return out
