"""What a service plugged into the agent looks like."""

from __future__ import annotations

from collections.abc import Callable, Mapping
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


# A client's JSON object, any user's: every field is checked (the *_arg helpers) before use.
Request = Mapping[str, object]
# A handler's answer; the server adds ``ok`` and sends it as one line of JSON.
Response = dict[str, object]
Handler = Callable[[Request, Peer], Response]


class RequestError(Exception):
    """A request a handler refuses; the message goes back to the client as ``error``."""


def int_arg(request: Request, key: str) -> int:
    """A non-negative integer field; decimal digits in a string are taken too (as older
    clients sent them), a bool or a float never."""
    value = request.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        return int(value)
    raise RequestError(f"{key} must be a non-negative integer, got {str(value)[:40]!r}")


def str_arg(request: Request, key: str, *, default: str | None = None,
            limit: int = 4096) -> str:
    """A string field of at most ``limit`` characters; ``default`` when absent or null."""
    value = request.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, str):
        raise RequestError(f"{key} must be a string, got {str(value)[:40]!r}")
    if len(value) > limit:
        raise RequestError(f"{key} is longer than {limit} characters")
    return value


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
    for long (hand long work to a thread of its own). A service with a deadline sets
    ``own_thread = True`` and ticks on a thread of its own instead, then shares its state
    with its handlers under a lock. ``handlers`` maps request ``op`` names to functions
    answering socket requests.
    """

    name: str
    interval_s: float

    def tick(self) -> None: ...

    def handlers(self) -> dict[str, Handler]: ...

    def close(self) -> None: ...
