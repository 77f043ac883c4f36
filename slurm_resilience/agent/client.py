"""Talk to the node agent from a job, a hook or the CLI."""

from __future__ import annotations

import contextlib
import json
import socket

from slurm_resilience.clock import Clock, SystemClock

# The agent's answer, one JSON object; callers check the type of each field they use.
Answer = dict[str, object]

BUSY_PAUSE_S = 0.02  # first pause after a "busy" answer; it doubles up to 0.5 s


class AgentUnavailable(Exception):
    """The agent's socket is missing, does not answer, or is busy (over its caps)."""


class AgentRefused(Exception):
    """The agent answered with an error."""


def call(path: str, op: str, *, timeout: float = 5.0,
         clock: Clock = SystemClock(), **args: object) -> Answer:
    """Send one request and return the answer; raises on transport errors and refusals.

    An agent over its connection caps answers "busy" at once; the call tries again, with
    a growing pause, until ``timeout`` has passed (a burst of a job's own ranks gets
    through), then raises :class:`AgentUnavailable` like an agent that can't be reached.
    The wait is read and slept on ``clock``.
    """
    request = json.dumps({"op": op, **args}).encode() + b"\n"
    deadline = clock.monotonic() + timeout
    pause = BUSY_PAUSE_S
    while True:
        answer = _once(path, request, max(deadline - clock.monotonic(), 0.01))
        if not answer.get("busy"):
            break
        left = deadline - clock.monotonic()
        if left <= 0:
            raise AgentUnavailable(f"agent: couldn't get a connection at {path}: "
                                   f"{answer.get('error', 'busy')}")
        clock.sleep(min(pause, left))
        pause = min(pause * 2, 0.5)
    if not answer.get("ok"):
        raise AgentRefused(str(answer.get("error", "refused")))
    return answer


def _once(path: str, request: bytes, timeout: float) -> Answer:
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
    return answer


def list_field(answer: Answer, key: str) -> list[object]:
    """``answer[key]`` when it is a list; an empty list when absent or of another type."""
    value = answer.get(key)
    return list(value) if isinstance(value, list) else []
