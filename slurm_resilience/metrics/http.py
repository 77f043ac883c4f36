"""The agent's /metrics HTTP server, bounded like its unix socket.

prometheus_client's own server starts a thread per connection without a cap and waits on
a client as long as it likes; on a node where any user can connect to the endpoint, that
is a way to grow the root agent's threads. This one admits at most ``max_connections``
at once (one more is closed at once, without a thread) and gives each connection
``io_timeout`` seconds in all to send its request and take its answer.
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from slurm_resilience.log import get_logger
from slurm_resilience.logbudget import LogBudget, user_text

MAX_CONNECTIONS = 8
IO_TIMEOUT_S = 10.0

log = get_logger("metrics")


class _Quiet(WSGIRequestHandler):
    timeout = IO_TIMEOUT_S  # the socket's timeout for each read and write

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (one a node every 15 s)."""


class BoundedServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    refused = 0

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        # Anyone who reaches the port can reset connections mid-request, as often as they like.
        self.failed_log = LogBudget(log, "connections that failed", level="info")
        super().server_activate()

    def in_use(self) -> int:
        """Connections being served now."""
        return self.max_connections - int(self._slots._value)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)  # over the cap: closed, no thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A budgeted line per peer, not socketserver's traceback on stderr each time."""
        exc = sys.exc_info()[1]
        peer = str(client_address[0]) if client_address else "unknown"
        ours = not isinstance(exc, OSError)  # a client's reset is theirs; anything else ours
        self.failed_log.log(f"peer {peer}", "metrics: http: couldn't answer a connection",
                            level="error" if ours else None, exc_info=ours, peer=peer,
                            error=user_text(f"{type(exc).__name__}: {exc}"))

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve(addr: str, port: int, registry: CollectorRegistry,
          max_connections: int = MAX_CONNECTIONS,
          wrap: Callable[[Any], Any] | None = None) -> BoundedServer:
    """Listen and serve on a daemon thread; ``shutdown()`` and ``server_close()`` stop it.
    ``wrap``: a WSGI app around the Prometheus one (the agents' questions, see queries)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    class Server(BoundedServer):
        address_family = family

    Server.max_connections = max_connections
    app = make_wsgi_app(registry)
    httpd = make_server(addr, port, wrap(app) if wrap else app, Server, handler_class=_Quiet)
    assert isinstance(httpd, BoundedServer)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
