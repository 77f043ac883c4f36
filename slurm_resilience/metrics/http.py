"""The agent's /metrics HTTP server: one event loop reads every request, so a slow client
costs a descriptor, never a worker.

prometheus_client's own server (and wsgiref's) waits on each client in a thread with a
timeout per read: eight clients sending a header line every 5 s held every thread and no
scrape was answered. Here an asyncio loop reads each request head within one deadline for
the whole of it (``request_timeout_s``, however it trickles) and only a complete request
goes to a worker, which runs the WSGI app (the Prometheus registry, the agents' questions,
see :mod:`slurm_resilience.queries`); the loop writes the answer within
``write_timeout_s``. At ``max_connections`` a new connection evicts one still sending its
request (or still taking its answer): of the peer address holding the most such
connections, the oldest, preferring one that had ``EVICT_AFTER_S`` to send (a burst of
new connections should not evict one accepted with them before its request was read).
So a scraper on another address is never evicted by others' connections, and one on the
same address only by a burst of ``max_connections`` in the moment before its request is
read. One peer has at most ``MAX_ANSWERING_PER_PEER`` requests with the workers; more are
answered 503 at once.
"""

from __future__ import annotations

import asyncio
import io
import re
import socket
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, make_wsgi_app

from slurm_resilience.log import get_logger

log = get_logger("metrics")

MAX_CONNECTIONS = 64
REQUEST_TIMEOUT_S = 5.0  # for the whole request head, not for each read
WRITE_TIMEOUT_S = 10.0  # for the whole answer
WORKERS = 4
MAX_ANSWERING_PER_PEER = 2
SUMMARY_EVERY_S = 60.0  # at most one log line a minute about cut or refused connections
EVICT_AFTER_S = 0.05  # a younger connection's request may be on its way: evict older first
MAX_HEAD_BYTES = 16 << 10  # a munge credential in a header is at most 4 KiB
MAX_HEADERS = 64
# Connections waiting for accept(): a deep queue, so a flood of connects doesn't make a
# scraper's SYN wait for a retransmit (1 s); but few accepted in one go.
BACKLOG = 512
ACCEPT_BATCH = 16
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,64}$")
_METHOD = re.compile(r"^[A-Z]{1,16}$")

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class Stage(Enum):
    """Where a connection is: only one with the workers can't be evicted."""

    READING = "reading"
    ANSWERING = "answering"
    WRITING = "writing"


@dataclass
class HttpStats:
    """Counters for tests, benchmarks and the agent's own metrics; each counts connections."""

    served: int = 0  # an answer written whole (any status)
    evicted: int = 0  # cut to make room for a new connection
    refused: int = 0  # closed at once: every slot held by requests with the workers
    timed_out: int = 0  # request not whole, or answer not taken, by its deadline
    bad: int = 0  # answered 4xx/5xx by the server itself (not HTTP, too big, a body, busy)
    peak_open: int = 0


@dataclass
class _Conn:
    peer: str
    writer: asyncio.StreamWriter
    since: float
    stage: Stage = Stage.READING
    evicted: bool = False


class _Bad(Exception):
    """A request the server answers itself, with ``status``."""

    def __init__(self, status: str, why: str):
        super().__init__(why)
        self.status = status


def response(status: str, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
    """An HTTP/1.1 answer that closes the connection (one request per connection)."""
    lines = [f"HTTP/1.1 {status}"]
    lines += [f"{k}: {v}" for k, v in headers
              if k.lower() not in ("connection", "content-length", "transfer-encoding")]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def _plain(status: str, text: str) -> bytes:
    return response(status, [("Content-Type", "text/plain; charset=utf-8")],
                    text.encode() + b"\n")


def parse_head(head: bytes, peer: str, server: tuple[str, int]) -> dict[str, Any]:
    """The WSGI environ of a GET request's head (request line and headers); raises
    :class:`_Bad` for anything else. Requests have no body here."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _METHOD.match(parts[0]) or not parts[1].startswith("/") \
            or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise _Bad("400 Bad Request", "not an HTTP/1 request line")
    method, target, version = parts
    if method != "GET":
        raise _Bad("405 Method Not Allowed", f"{method} is not served here, only GET")
    path, _, query = target.partition("?")
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method, "SCRIPT_NAME": "", "PATH_INFO": unquote(path, "latin-1"),
        "QUERY_STRING": query, "SERVER_NAME": server[0], "SERVER_PORT": str(server[1]),
        "SERVER_PROTOCOL": version, "REMOTE_ADDR": peer, "CONTENT_LENGTH": "",
        "CONTENT_TYPE": "", "wsgi.version": (1, 0), "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(b""), "wsgi.errors": sys.stderr, "wsgi.multithread": True,
        "wsgi.multiprocess": False, "wsgi.run_once": False,
    }
    count = 0
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.match(name):
            raise _Bad("400 Bad Request", "a header line is not 'Name: value'")
        count += 1
        if count > MAX_HEADERS:
            raise _Bad("431 Request Header Fields Too Large", f"over {MAX_HEADERS} headers")
        key = name.upper().replace("-", "_")
        value = value.strip(" \t")
        if key == "TRANSFER_ENCODING" or (key == "CONTENT_LENGTH" and value != "0"):
            raise _Bad("413 Content Too Large", "requests with a body are not served here")
        if key in ("CONTENT_LENGTH", "CONTENT_TYPE"):
            environ[key] = value
            continue
        key = "HTTP_" + key
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


def run_app(app: WsgiApp, environ: dict[str, Any]) -> bytes:
    """Run a WSGI app for one request on a worker; its whole answer as bytes."""
    started: list[tuple[str, list[tuple[str, str]]]] = []
    body: list[bytes] = []

    def start_response(status: str, headers: list[tuple[str, str]],
                       exc_info: Any = None) -> Callable[[bytes], None]:
        started[:] = [(status, list(headers))]
        return body.append

    try:
        result = app(environ, start_response)
        try:
            body.extend(result)
        finally:
            close = getattr(result, "close", None)
            if callable(close):
                close()
        status, headers = started[0]
    except Exception as exc:  # noqa: BLE001 - answered 500 and logged, the server goes on
        log.error("metrics: http: couldn't answer a request", path=environ["PATH_INFO"][:80],
                  error=f"{type(exc).__name__}: {exc}")
        return _plain("500 Internal Server Error", f"couldn't answer: {type(exc).__name__}")
    return response(status, headers, b"".join(body))


class MetricsServer:
    """Serves a WSGI app on its own event-loop thread; ``shutdown()`` then
    ``server_close()`` stop it."""

    def __init__(self, addr: str, port: int, app: WsgiApp, *,
                 max_connections: int = MAX_CONNECTIONS,
                 request_timeout_s: float = REQUEST_TIMEOUT_S,
                 write_timeout_s: float = WRITE_TIMEOUT_S, workers: int = WORKERS):
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.sock = socket.create_server((addr, port), family=family, backlog=BACKLOG)
        self.server_address: tuple[str, int] = self.sock.getsockname()[:2]
        self.app = app
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.write_timeout_s = write_timeout_s
        self.stats = HttpStats()
        self.open: dict[int, _Conn] = {}  # oldest first; touched on the loop's thread only
        self.answering: Counter[str] = Counter()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="metrics-app")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)
        self._ready = threading.Event()
        self._next_summary = 0.0
        self._summarised: dict[str, int] = {}

    def start(self) -> MetricsServer:
        self.thread.start()
        self._ready.wait(30)
        return self

    def in_use(self) -> int:
        """Connections open now."""
        return len(self.open)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        # asyncio accepts up to ``backlog`` connections in one go, then listen()s with it:
        # a small batch (so a burst is admitted in steps, with reads between), then the
        # deep queue again.
        server = self.loop.run_until_complete(asyncio.start_server(
            self._client, sock=self.sock, limit=MAX_HEAD_BYTES, backlog=ACCEPT_BATCH))
        self.sock.listen(BACKLOG)
        self._ready.set()
        try:
            self.loop.run_forever()
        finally:
            server.close()
            # Connections accepted just before the stop start their tasks late: cancel in
            # rounds until none is left; what they raise on the way out is of no interest.
            self.loop.set_exception_handler(lambda loop, context: None)
            for _ in range(10):
                tasks = asyncio.all_tasks(self.loop)
                if not tasks:
                    break
                for task in tasks:
                    task.cancel()
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.close()

    def shutdown(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def server_close(self) -> None:
        self.sock.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- on the loop's thread --------------------------------------------------------------

    def _count(self, what: str) -> None:
        """Count a connection cut or refused; log at once, then at most a line a minute
        with the counts since (no line per connection: any user can make these)."""
        setattr(self.stats, what, getattr(self.stats, what) + 1)
        now = self.loop.time()
        if now < self._next_summary:
            return
        self._next_summary = now + SUMMARY_EVERY_S
        counts = {k: getattr(self.stats, k) for k in ("evicted", "timed_out", "refused", "bad")}
        since = {k: v - self._summarised.get(k, 0) for k, v in counts.items()}
        self._summarised = counts
        log.warning("metrics: http: cut or refused connections (slow, idle or malformed "
                    "clients) since the last such line", **since)

    def _admit(self, conn: _Conn) -> bool:
        """Take a slot, evicting if need be; False when every slot is with the workers."""
        if len(self.open) >= self.max_connections:
            held: Counter[str] = Counter(c.peer for c in self.open.values()
                                         if c.stage is not Stage.ANSWERING)
            if not held:
                self._count("refused")
                return False
            most = held.most_common(1)[0][0]
            mine = [(k, c) for k, c in self.open.items()
                    if c.peer == most and c.stage is not Stage.ANSWERING]
            old = conn.since - EVICT_AFTER_S
            key, victim = next(((k, c) for k, c in mine if c.since <= old), mine[0])
            del self.open[key]
            victim.evicted = True
            self._count("evicted")
            victim.writer.transport.abort()
        self.open[id(conn)] = conn
        self.stats.peak_open = max(self.stats.peak_open, len(self.open))
        return True

    async def _client(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        conn = _Conn(str(peername[0]) if peername else "?", writer, self.loop.time())
        if not self._admit(conn):
            writer.transport.abort()
            return
        served = False
        try:
            answer = await self._answer(reader, conn)
            if answer is None:
                return
            conn.stage = Stage.WRITING
            writer.transport.set_write_buffer_limits(high=0)  # drain() waits for all of it
            writer.write(answer)
            await asyncio.wait_for(writer.drain(), self.write_timeout_s)
            self.stats.served += 1
            served = True
        except asyncio.TimeoutError:
            self._count("timed_out")
        except (ConnectionError, OSError):
            pass  # the client went, or was evicted
        finally:
            self.open.pop(id(conn), None)
            if served:
                writer.close()  # all written: a normal close
            else:
                writer.transport.abort()

    async def _answer(self, reader: asyncio.StreamReader, conn: _Conn) -> bytes | None:
        """The answer to the request on ``conn``; None when there is none to give."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                          self.request_timeout_s)
        except asyncio.TimeoutError:
            self._count("timed_out")
            return None
        except asyncio.IncompleteReadError:
            return None  # closed before a whole request (or evicted)
        except asyncio.LimitOverrunError:
            self._count("bad")
            return _plain("431 Request Header Fields Too Large",
                          f"request head over {MAX_HEAD_BYTES} bytes")
        try:
            environ = parse_head(head, conn.peer, self.server_address)
        except _Bad as exc:
            self._count("bad")
            return _plain(exc.status, str(exc))
        if self.answering[conn.peer] >= MAX_ANSWERING_PER_PEER:
            self._count("bad")
            return _plain("503 Service Unavailable",
                          f"busy: {MAX_ANSWERING_PER_PEER} requests of {conn.peer} are "
                          "being answered")
        conn.stage = Stage.ANSWERING
        self.answering[conn.peer] += 1
        try:
            return await self.loop.run_in_executor(self.pool, run_app, self.app, environ)
        finally:
            self.answering[conn.peer] -= 1
            if not self.answering[conn.peer]:
                del self.answering[conn.peer]


def serve(addr: str, port: int, registry: CollectorRegistry,
          max_connections: int = MAX_CONNECTIONS,
          wrap: Callable[[Any], Any] | None = None) -> MetricsServer:
    """Listen and serve on a daemon thread; ``shutdown()`` and ``server_close()`` stop it.
    ``wrap``: a WSGI app around the Prometheus one (the agents' questions, see queries)."""
    app = make_wsgi_app(registry)
    return MetricsServer(addr, port, wrap(app) if wrap else app,
                         max_connections=max_connections).start()
