"""The agent's unix-socket server: one JSON object per line in, one per line out.

Nothing a client sends is evaluated or unpickled: requests are JSON, bounded in
size, and every handler is told the caller's uid/gid/pid from SO_PEERCRED.

Everything a local user can grow is bounded: connections in total and per uid (a
connection over a cap is answered "busy" and closed at once, without a thread), the
time to send one request and to take its answer (a deadline per connection, not per
read), and the request's size. Root (the hooks) has a few slots of its own, so a
user's flood can't shut out a prolog, and the last ``newcomer_reserve`` slots go only to
users who have no connection open, so a few users' floods can't shut out another. At fd
exhaustion the accept loop backs off instead of spinning, and the clients already in are
served.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import socket
import stat
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from slurm_resilience.agent.service import Handler, Peer, RequestError, Response
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.log import get_logger
from slurm_resilience.logbudget import LogBudget, user_text

log = get_logger("agent")

_UCRED = struct.Struct("3i")
# Errors of accept() that mean "out of fds or memory": wait, don't spin.
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 1.0
ROOT_RESERVE = 8  # connections only uid 0 (the hooks) may use once the others are taken
NEWCOMER_RESERVE = 16  # of max_connections, only for a uid with none open
_WARN_EVERY_S = 60.0  # one warning per kind of refusal and uid per minute: no log flood
_REFUSED_PER_MINUTE = 10  # lines per uid a minute for refused requests, then a summary


def peer_of(sock: socket.socket) -> Peer:
    """Kernel-verified credentials of the process at the other end."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid)


class _Incomplete(Exception):
    """A request that did not arrive whole: too slow or too big."""


@dataclass
class ServerStats:
    """Counters a test or a status line can read."""

    admitted: int = 0
    busy: int = 0  # refused over a cap
    timed_out: int = 0
    too_big: int = 0
    accept_errors: int = 0
    peak_connections: int = 0


class AgentServer:
    """Accepts on one thread; each admitted connection gets a thread, up to the caps."""

    def __init__(self, path: str, *, max_bytes: int = 65536, io_timeout: float = 30.0,
                 max_connections: int = 128, max_per_uid: int = 32,
                 root_reserve: int = ROOT_RESERVE, newcomer_reserve: int = NEWCOMER_RESERVE,
                 backlog: int = 256,
                 clock: Clock = SystemClock()):
        self.path = path
        self.max_bytes = max_bytes
        self.io_timeout = io_timeout
        self.max_connections = max_connections
        self.max_per_uid = max_per_uid
        self.root_reserve = root_reserve
        self.newcomer_reserve = max(0, min(newcomer_reserve, max_connections - 1))
        self.clock = clock
        self.routes: dict[str, Handler] = {}
        self.routes_lock = threading.Lock()
        self.stats = ServerStats()
        self._open: Counter[int] = Counter()  # uid -> admitted connections now
        self._lock = threading.Lock()
        self.connection_log = LogBudget(log, "refused or failed connections", lines=1,
                                        window_s=_WARN_EVERY_S, clock=clock)
        self.request_log = LogBudget(log, "refused requests", lines=_REFUSED_PER_MINUTE,
                                     clock=clock)
        self._backoff = 0.0
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
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
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.socket.bind(path)
            self.socket.listen(backlog)
        except OSError:
            self.socket.close()
            raise
        self.socket.setblocking(False)
        # Any local user may connect; handlers decide with the peer's credentials.
        os.chmod(path, 0o666)  # noqa: S103
        self._wake_r, self._wake_w = os.pipe()

    # -- routes ---------------------------------------------------------------------------

    def route(self, op: str, handler: Handler) -> None:
        with self.routes_lock:
            if op in self.routes:
                raise ValueError(f"agent: two services answer op {op!r}")
            self.routes[op] = handler

    # -- the accept loop ------------------------------------------------------------------

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([self.socket.fileno(), self._wake_r], [], [],
                                            poll_interval)
                if self.socket.fileno() in ready:
                    delay = self.accept_one()
                    if delay:
                        self._stop.wait(delay)  # out of fds: let connections finish first
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop the accept loop (connections being served finish on their own)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def accept_one(self) -> float:
        """Accept one connection and admit or refuse it; returns how long to pause accepting
        (0, or a growing back-off while the process is out of fds)."""
        try:
            conn, _ = self.socket.accept()
        except (BlockingIOError, InterruptedError):
            return 0.0
        except OSError as exc:
            self.stats.accept_errors += 1
            if exc.errno not in _EXHAUSTED:
                self._warn("accept", 0, "agent: accept: couldn't accept a connection",
                           error=str(exc))
                return BACKOFF_MIN_S
            self._backoff = min(max(self._backoff * 2, BACKOFF_MIN_S), BACKOFF_MAX_S)
            self._warn("exhausted", 0, "agent: accept: couldn't accept a connection: out of "
                       "file descriptors; pausing", error=str(exc), pause_s=self._backoff)
            return self._backoff
        self._backoff = 0.0
        try:
            peer = peer_of(conn)
        except OSError as exc:
            conn.close()
            self._warn("peercred", 0, "agent: accept: couldn't read the peer's credentials",
                       error=str(exc))
            return 0.0
        why = self._admit(peer.uid)
        if why:
            self._refuse(conn, peer, why)
            return 0.0
        try:
            threading.Thread(target=self._serve, args=(conn, peer), name="agent-conn",
                             daemon=True).start()
        except RuntimeError as exc:  # can't start new thread: the process is at its limit
            self._release(peer.uid)
            self._refuse(conn, peer, f"can't start a thread: {exc}")
        return 0.0

    def connections(self) -> int:
        with self._lock:
            return sum(self._open.values())

    def _admit(self, uid: int) -> str:
        """Take a slot for ``uid``; returns why not ('' when admitted)."""
        with self._lock:
            total = sum(self._open.values())
            if uid != 0 and self._open[uid] >= self.max_per_uid:
                return f"{self._open[uid]} connections from uid {uid} (cap {self.max_per_uid})"
            if uid == 0:
                cap = self.max_connections + self.root_reserve
            elif self._open[uid]:  # the reserve is for users with nothing open
                cap = self.max_connections - self.newcomer_reserve
                if total >= cap:
                    return (f"{total} connections in all, {self._open[uid]} of them uid "
                            f"{uid}'s (cap {cap}; {self.newcomer_reserve} more are kept for "
                            "users with none open)")
            else:
                cap = self.max_connections
            if total >= cap:
                return f"{total} connections in all (cap {cap})"
            self._open[uid] += 1
            self.stats.admitted += 1
            self.stats.peak_connections = max(self.stats.peak_connections, total + 1)
            return ""

    def _release(self, uid: int) -> None:
        with self._lock:
            self._open[uid] -= 1
            if self._open[uid] <= 0:
                del self._open[uid]

    def _refuse(self, conn: socket.socket, peer: Peer, why: str) -> None:
        self.stats.busy += 1
        self._warn("busy", peer.uid, "agent: accept: refused a connection: busy",
                   uid=peer.uid, pid=peer.pid, why=why)
        answer = {"ok": False, "busy": True, "error": f"agent: busy: {why}"}
        with contextlib.suppress(OSError):  # never wait on a client we are turning away
            conn.send(json.dumps(answer).encode() + b"\n", socket.MSG_DONTWAIT)
        conn.close()

    def _warn(self, kind: str, who: int, event: str, **fields: Any) -> None:
        self.connection_log.log(f"uid {who} ({kind})", event, **fields)

    # -- one connection -------------------------------------------------------------------

    def _serve(self, conn: socket.socket, peer: Peer) -> None:
        try:
            try:
                line = self._read_request(conn)
            except _Incomplete as exc:
                self._reply(conn, {"ok": False, "error": str(exc)})
                return
            except OSError as exc:
                log.debug("agent: couldn't read request", error=str(exc), uid=peer.uid)
                return
            self._reply(conn, self.dispatch(line, peer))
        finally:
            conn.close()
            self._release(peer.uid)

    def _read_request(self, conn: socket.socket) -> bytes:
        """One line, whole within ``io_timeout`` and ``max_bytes``: a client that trickles
        bytes is cut at the same deadline as one that sends nothing."""
        deadline = self.clock.monotonic() + self.io_timeout
        buf = bytearray()
        while b"\n" not in buf:
            if len(buf) > self.max_bytes:
                break
            left = deadline - self.clock.monotonic()
            if left <= 0:
                self.stats.timed_out += 1
                raise _Incomplete(f"agent: couldn't read request: not complete within "
                                  f"{self.io_timeout:g}s")
            conn.settimeout(left)
            try:
                chunk = conn.recv(min(65536, self.max_bytes + 1 - len(buf)) or 1)
            except TimeoutError:
                continue  # the deadline check above answers
            if not chunk:
                break  # EOF: what came is the request
            buf += chunk
        line = bytes(buf).split(b"\n", 1)[0]
        if len(line) > self.max_bytes:
            self.stats.too_big += 1
            raise _Incomplete(f"request larger than {self.max_bytes} bytes")
        return line

    def _reply(self, conn: socket.socket, response: Response) -> None:
        try:
            conn.settimeout(self.io_timeout)
            conn.sendall(json.dumps(response, default=str).encode() + b"\n")
        except OSError as exc:
            log.debug("agent: couldn't send answer", error=str(exc))

    def dispatch(self, line: bytes, peer: Peer) -> Response:
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
            return {"ok": False, "error": f"unknown op {op[:64]!r}; known: {known}"}
        try:
            answer = handler(request, peer)
        except RequestError as exc:
            self.request_log.log(f"uid {peer.uid}", "agent: request refused", op=op,
                                 uid=peer.uid, pid=peer.pid, error=user_text(exc))
            return {"ok": False, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - logged with its traceback and answered
            self.request_log.log(f"uid {peer.uid}", "agent: request handler failed", op=op,
                                 uid=peer.uid, error=user_text(f"{type(exc).__name__}: {exc}"),
                                 level="error", exc_info=True)
            return {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}
        return {"ok": True, **answer}
