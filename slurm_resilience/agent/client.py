"""Talk to the node agent from a job, a hook or the CLI."""

from __future__ import annotations

import contextlib
import json
import socket
from typing import Any


class AgentUnavailable(Exception):
    """The agent's socket is missing, does not answer, or is busy (over its caps)."""


class AgentRefused(Exception):
    """The agent answered with an error."""


def call(path: str, op: str, *, timeout: float = 5.0, **args: Any) -> dict[str, Any]:
    """Send one request and return the answer; raises on transport errors and refusals."""
    request = json.dumps({"op": op, **args}).encode() + b"\n"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            # Turned away at once: its "busy" answer may still be waiting to be read.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(request)
            chunks: list[bytes] = []
            while not chunks or not chunks[-1].endswith(b"\n"):
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
    except (OSError, TimeoutError) as exc:
        raise AgentUnavailable(f"agent: couldn't reach {path}: {exc}") from exc
    try:
        answer = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise AgentUnavailable(f"agent: unreadable answer from {path}") from exc
    if not isinstance(answer, dict):
        raise AgentUnavailable(f"agent: unreadable answer from {path}")
    if answer.get("busy"):
        # Over the agent's connection caps: as good as unreachable for the caller's fallback.
        raise AgentUnavailable(f"agent: couldn't get a connection at {path}: "
                               f"{answer.get('error', 'busy')}")
    if not answer.get("ok"):
        raise AgentRefused(str(answer.get("error", "refused")))
    return answer
