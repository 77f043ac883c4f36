"""A hook's first move: have the node's hook server run it, in a worker forked from a
process that has the configuration and every step's modules loaded already.

``run`` answers the hook's exit status, or None with the reason the hook must run in its
own process instead (no server, a refusal, a server that is not root's). Nothing runs
twice: the worker runs only after this side's ``go``, which is sent once, after
``started``; from then on the worker's status is the hook's, and a worker that vanishes
without one is reported, never re-run (its steps may have acted). A hook that gave up
waiting sent no ``go``, so its worker never runs.
Imports are stdlib only: this is the part every job's prolog pays for.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Mapping

from slurm_resilience.config import DEFAULT_PATH
from slurm_resilience.hooks import endpoint

CONNECT_TIMEOUT_S = 1.0
START_TIMEOUT_S = 5.0  # the server forks at once; a server this slow is as good as gone
_UCRED = struct.Struct("3i")

# The worker ended without telling its status (killed, say): the hook reports it and exits
# with this, which the runner's caller maps to the hook's failure policy.
LOST = -1


class Outcome:
    """What the server did with the hook: ``rc`` when it ran it, else ``why`` not."""

    __slots__ = ("rc", "started", "why")

    def __init__(self, rc: int | None, why: str, started: bool = False):
        self.rc = rc
        self.why = why
        self.started = started


def _std_fds() -> list[int]:
    """The hook's stdin, stdout and stderr (slurmd may leave one closed: /dev/null then)."""
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open(os.devnull, os.O_RDWR))
    return fds


def _read_line(sock: socket.socket, buf: bytearray) -> str | None:
    while b"\n" not in buf:
        chunk = sock.recv(256)
        if not chunk:
            return None
        buf += chunk
        if len(buf) > 4096:
            return None
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line.decode("utf-8", "replace")


def run(kind: str, argv: list[str], env: Mapping[str, str], config_path: str | None,
        node: str, directory: str = endpoint.SOCKET_DIR) -> Outcome:
    real = endpoint.config_key(config_path, DEFAULT_PATH)
    try:
        path = endpoint.socket_path(real, node, directory)
    except ValueError as exc:
        return Outcome(None, str(exc))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(path)
        except FileNotFoundError:
            # A server under another name may be this node's (the names disagree) or
            # another slurmd's on the same host (a sandbox): name them, claim neither.
            others = [n for n in endpoint.nodes_serving(real, directory) if n != node[:48]]
            if others:
                return Outcome(None, f"no hook server at {path}; this configuration's "
                                     f"servers here listen as node {', '.join(others[:4])}: "
                                     f"if this node is one of them, the hook's node name "
                                     f"{node!r} (SLURMD_NODENAME) and the server's (--node "
                                     "or node.name) disagree")
            return Outcome(None, f"no hook server at {path}")
        except OSError as exc:
            return Outcome(None, f"hook server at {path}: {exc.strerror or exc}")
        uid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                            _UCRED.size))[1]
        if uid != 0:
            return Outcome(None, f"hook server at {path} runs as uid {uid}, not root")
        request = json.dumps({
            "v": endpoint.VERSION, "kind": kind, "argv": argv, "env": dict(env),
            "cwd": os.getcwd(), "umask": _umask(), "config": real,
        }).encode()
        if len(request) > endpoint.MAX_REQUEST_BYTES:
            return Outcome(None, f"hook environment too large for the hook server "
                                 f"({len(request)} bytes)")
        sock.settimeout(START_TIMEOUT_S)
        payload = endpoint.frame(request)
        sent = socket.send_fds(sock, [payload], _std_fds())
        if sent < len(payload):
            sock.sendall(payload[sent:])
        buf = bytearray()
        first = _read_line(sock, buf)
        if first != "started":
            why = (first or "").removeprefix("refused: ") or "it closed the connection"
            return Outcome(None, f"hook server refused: {why}")
        try:
            sock.sendall(endpoint.GO)
        except OSError as exc:  # not delivered, so the worker never runs
            return Outcome(None, f"hook server's worker went before the hook's go: {exc}")
        sock.settimeout(None)  # the worker's own watchdog bounds the hook
        last = _read_line(sock, buf)
        if last and last.startswith("rc ") and last[3:].isdigit():
            return Outcome(int(last[3:]), "", started=True)
        if last and last.startswith("abandoned: "):  # our go came too late: nothing ran
            return Outcome(None, f"hook server's worker {last}")
        return Outcome(LOST, f"the hook server's worker ended without an exit status "
                             f"({last or 'connection closed'})", started=True)
    except OSError as exc:
        return Outcome(None, f"hook server at {path}: {exc}")
    finally:
        sock.close()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
