"""The agent's unix-socket server: one JSON object per line in, one per line out.

Nothing a client sends is evaluated or unpickled: requests are JSON, bounded in
size, and every handler is told the caller's uid/gid/pid from SO_PEERCRED.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import stat
import struct
import threading
from typing import Any

from slurm_resilience.agent.service import Handler, Peer, RequestError
from slurm_resilience.log import get_logger

log = get_logger("agent")

_UCRED = struct.Struct("3i")


def peer_of(sock: socket.socket) -> Peer:
    """Kernel-verified credentials of the process at the other end."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid)


class _RequestHandler(socketserver.StreamRequestHandler):
    server: AgentServer

    def handle(self) -> None:
        peer = peer_of(self.connection)
        self.connection.settimeout(self.server.io_timeout)
        try:
            line = self.rfile.readline(self.server.max_bytes + 1)
        except OSError as exc:
            log.warning("couldn't read request", error=str(exc), uid=peer.uid)
            return
        if len(line) > self.server.max_bytes:
            too_big = f"request larger than {self.server.max_bytes} bytes"
            self._reply({"ok": False, "error": too_big})
            return
        self._reply(self.server.dispatch(line, peer))

    def _reply(self, response: dict[str, Any]) -> None:
        try:
            self.wfile.write(json.dumps(response, default=str).encode() + b"\n")
        except OSError as exc:
            log.warning("couldn't send answer", error=str(exc))


class AgentServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Threaded so a slow handler (a stage-in) does not block heartbeat queries."""

    daemon_threads = True

    def __init__(self, path: str, *, max_bytes: int = 65536, io_timeout: float = 30.0):
        self.path = path
        self.max_bytes = max_bytes
        self.io_timeout = io_timeout
        self.routes: dict[str, Handler] = {}
        self.routes_lock = threading.Lock()
        parent = os.path.dirname(path)
        os.makedirs(parent, mode=0o755, exist_ok=True)
        st = os.lstat(parent)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise RuntimeError(f"agent: socket directory {parent} must be a real directory "
                               f"owned by uid {os.geteuid()}")
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # a stale socket from a previous run
        except FileNotFoundError:
            pass
        super().__init__(path, _RequestHandler)
        # Any local user may connect; handlers decide with the peer's credentials.
        os.chmod(path, 0o666)  # noqa: S103

    def route(self, op: str, handler: Handler) -> None:
        with self.routes_lock:
            if op in self.routes:
                raise ValueError(f"agent: two services answer op {op!r}")
            self.routes[op] = handler

    def dispatch(self, line: bytes, peer: Peer) -> dict[str, Any]:
        try:
            request = json.loads(line)
        except ValueError:
            return {"ok": False, "error": "request is not one line of JSON"}
        if not isinstance(request, dict) or not isinstance(request.get("op"), str):
            return {"ok": False, "error": "request must be a JSON object with a string 'op'"}
        op = request["op"]
        if op == "ping":
            return {"ok": True, "ops": sorted(self.routes)}
        handler = self.routes.get(op)
        if handler is None:
            known = ", ".join(sorted(self.routes))
            return {"ok": False, "error": f"unknown op {op!r}; known: {known}"}
        try:
            answer = handler(request, peer)
        except RequestError as exc:
            log.warning("request refused", op=op, uid=peer.uid, pid=peer.pid, error=str(exc))
            return {"ok": False, "error": str(exc)}
        except Exception as exc:
            log.exception("request handler failed", op=op, uid=peer.uid)
            return {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}
        return {"ok": True, **answer}
