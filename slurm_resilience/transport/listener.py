"""The exchange's TCP listener: its own bounded accept loop.

Bounds: connections open at once (total and per peer address; past a cap a connection is
closed at once, unread), one deadline per connection covering the whole read, a maximum
frame size, and a pause instead of a spin when accept fails for lack of descriptors.

A peer address is shared by every user of a node, so caps per address can't keep users
from holding the slots. With ``privileged_only`` a connection from a source port at or
above 1024 (one any user can bind; agents send from below, see ``wire.connect``) is closed
at once, unread: only root on a node can take a slot at all.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from slurm_resilience.log import get_logger
from slurm_resilience.logbudget import LogBudget, user_text
from slurm_resilience.transport.wire import MessageError, read_frame

log = get_logger("heartbeat.exchange")
# Anyone who can reach the port decides how often these happen.
_UNREAD_LOG = LogBudget(log, "messages not read", level="info")
_ACCEPT_LOG = LogBudget(log, "failed accepts", lines=1)

Handler = Callable[[bytes, str], str]
# accept() failing for lack of resources: pause (doubling up to the maximum), don't spin.
_RESOURCE_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
PAUSE_S, MAX_PAUSE_S = 0.05, 1.0
MAX_REPLY = 200
SUMMARY_EVERY_S = 60.0


@dataclass
class ListenerStats:
    """Counters for tests, benchmarks and the log."""

    accepted: int = 0
    refused_cap: int = 0
    refused_peer_cap: int = 0
    refused_port: int = 0  # from an unprivileged source port (privileged_only)
    failed: int = 0
    paused: int = 0
    longest_pause_s: float = 0.0
    bytes_in: int = 0
    peak_open: int = 0
    open_by_peer: Counter[str] = field(default_factory=Counter)


class Listener:
    """Accepts connections, reads one frame from each and answers ``handle(frame, peer_ip)``."""

    def __init__(self, bind: str, port: int, handle: Handler, *, max_connections: int,
                 max_per_peer: int, io_timeout_s: float, max_frame_bytes: int,
                 privileged_only: bool = False, backlog: int = 128):
        self.handle = handle
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.io_timeout_s = io_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.privileged_only = privileged_only
        self._next_summary = 0.0
        self._summarised = 0
        self.stats = ListenerStats()
        self.lock = threading.Lock()
        self.open = 0
        self.stopping = threading.Event()
        self.sock = socket.create_server((bind, port), backlog=backlog)
        self.sock.settimeout(0.5)  # so close() is noticed
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._loop, name=f"exchange-accept-{self.port}",
                                       daemon=True)

    def start(self) -> Listener:
        self.thread.start()
        return self

    def _loop(self) -> None:
        pause = PAUSE_S
        while not self.stopping.is_set():
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self.stopping.is_set():
                    return
                self.stats.paused += 1
                self.stats.longest_pause_s = max(self.stats.longest_pause_s, pause)
                if exc.errno in _RESOURCE_ERRORS:
                    _ACCEPT_LOG.log(exc.errno, "exchange: accept: couldn't accept a "
                                    "connection; pausing", error=exc.strerror, pause_s=pause)
                else:
                    _ACCEPT_LOG.log(exc.errno, "exchange: accept: couldn't accept a connection",
                                    error=str(exc))
                self.stopping.wait(pause)
                pause = min(pause * 2, MAX_PAUSE_S)
                continue
            pause = PAUSE_S
            peer = str(addr[0])
            with self.lock:
                if self.privileged_only and int(addr[1]) >= 1024:
                    self.stats.refused_port += 1
                    refused = True
                    self._summarise_ports(peer)
                elif self.open >= self.max_connections:
                    self.stats.refused_cap += 1
                    refused = True
                elif self.stats.open_by_peer[peer] >= self.max_per_peer:
                    self.stats.refused_peer_cap += 1
                    refused = True
                else:
                    refused = False
                    self.open += 1
                    self.stats.accepted += 1
                    self.stats.peak_open = max(self.stats.peak_open, self.open)
                    self.stats.open_by_peer[peer] += 1
            if refused:
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                                 name="exchange-conn").start()
            except RuntimeError as exc:  # no thread could be started
                log.warning("exchange: accept: couldn't start a connection thread",
                            error=str(exc))
                self._release(conn, peer)

    def _summarise_ports(self, peer: str) -> None:
        """Log the first connection from an unprivileged port, then at most a line a
        minute with the count since (any user can make these: no line per connection)."""
        now = time.monotonic()
        if now < self._next_summary:
            return
        self._next_summary = now + SUMMARY_EVERY_S
        log.warning("exchange: accept: closed connections from source ports above 1023 "
                    "(not an agent), unread", count=self.stats.refused_port - self._summarised,
                    last_peer=peer)
        self._summarised = self.stats.refused_port

    def _release(self, conn: socket.socket, peer: str) -> None:
        conn.close()
        with self.lock:
            self.open -= 1
            self.stats.open_by_peer[peer] -= 1
            if not self.stats.open_by_peer[peer]:
                del self.stats.open_by_peer[peer]

    def _serve(self, conn: socket.socket, peer: str) -> None:
        deadline = time.monotonic() + self.io_timeout_s
        try:
            frame = read_frame(conn, max_bytes=self.max_frame_bytes, deadline=deadline)
            with self.lock:
                self.stats.bytes_in += len(frame) + 4
            answer = self.handle(frame, peer)
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.sendall(answer.encode("ascii", "replace")[:MAX_REPLY] + b"\n")
        except (OSError, MessageError) as exc:
            with self.lock:
                self.stats.failed += 1
            _UNREAD_LOG.log(f"peer {peer}", "exchange: receive: couldn't read a message",
                            peer=peer, error=user_text(exc))
        finally:
            self._release(conn, peer)

    def close(self) -> None:
        self.stopping.set()
        self.sock.close()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(2)
