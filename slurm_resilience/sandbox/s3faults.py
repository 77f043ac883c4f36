"""A fault-injecting HTTP proxy in front of the sandbox's S3 server, for tests.

Requests are forwarded unchanged (the Host header included, so SigV4 signatures
still verify upstream). A test can make chosen requests fail the way a loaded S3
fails (``503 SlowDown`` with S3's XML error body, for keys containing a string,
a given number of times), or make the endpoint refuse connections altogether,
so the client code under test meets real protocol-level faults.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te",
        "upgrade", "trailer"}


@dataclass
class Fault:
    """Answer ``status``/``code`` to the next ``count`` requests whose path contains
    ``match`` (and whose method is ``method``, when given)."""

    match: str
    count: int
    status: int = 503
    code: str = "SlowDown"
    method: str | None = None
    injected: int = 0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        return

    def setup(self) -> None:
        super().setup()
        self.server.proxy.track(self.connection, add=True)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        self.server.proxy.track(self.connection, add=False)

    def _relay(self) -> None:
        proxy = self.server.proxy
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        proxy.log(self.command, self.path)
        fault = proxy.match(self.command, self.path)
        if fault is not None:
            payload = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{fault.code}'
                       f"</Code><Message>injected by the test's fault proxy</Message>"
                       f"<Resource>{self.path.split('?')[0]}</Resource>"
                       "<RequestId>fault</RequestId></Error>").encode()
            self.send_response(fault.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return
        conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP:
                    conn.putheader(name, value)
            conn.endheaders(body if body else None)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status, resp.reason)
            for name, value in resp.getheaders():
                if name.lower() not in _HOP and not (name.lower() == "content-length"
                                                     and self.command != "HEAD"):
                    self.send_header(name, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, proxy: S3FaultProxy) -> None:
        self.proxy = proxy
        super().__init__(("127.0.0.1", port), _Handler)


class S3FaultProxy:
    """``with S3FaultProxy(upstream_port) as p: p.url`` -- then ``fail()``, ``refuse()``."""

    def __init__(self, upstream_port: int, port: int = 0) -> None:
        self.upstream_port = upstream_port
        self.port = port
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._server: _Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> S3FaultProxy:
        self.accept()
        return self

    def __exit__(self, *exc: object) -> None:
        self.refuse()

    # -- what the test controls ---------------------------------------------------------

    def fail(self, match: str, count: int, status: int = 503, code: str = "SlowDown",
             method: str | None = None) -> Fault:
        fault = Fault(match, count, status, code, method)
        with self._lock:
            self.faults.append(fault)
        return fault

    def refuse(self) -> None:
        """Close the listening socket and every open connection: clients get refused."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def accept(self) -> None:
        """Listen (again, on the same port) and forward."""
        if self._server is not None:
            return
        self._server = _Server(self.port, self)
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy",
                         daemon=True).start()

    # -- used by the handler ---------------------------------------------------------------

    def match(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.count > 0 and fault.match in path and fault.method in (None, method):
                    fault.count -= 1
                    fault.injected += 1
                    return fault
        return None

    def log(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)
