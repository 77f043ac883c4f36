"""What a service plugged into the agent looks like."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from slurm_resilience.config import Config
from slurm_resilience.slurm.adapter import SlurmAdapter


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a socket request, as the kernel says (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


Request = dict[str, Any]
Response = dict[str, Any]
Handler = Callable[[Request, Peer], Response]


class RequestError(Exception):
    """A request a handler refuses; the message goes back to the client as ``error``."""


@dataclass
class AgentContext:
    """What a service factory gets: config, this node's name, the Slurm adapter."""

    cfg: Config
    node: str
    adapter: SlurmAdapter
    extra: dict[str, Any] = field(default_factory=dict)


class Service(Protocol):
    """A unit of work inside the agent.

    ``tick`` runs on the agent's loop thread every ``interval_s`` and must not block
    for long (hand long work to a thread of its own). ``handlers`` maps request
    ``op`` names to functions answering socket requests.
    """

    name: str
    interval_s: float

    def tick(self) -> None: ...

    def handlers(self) -> dict[str, Handler]: ...

    def close(self) -> None: ...
