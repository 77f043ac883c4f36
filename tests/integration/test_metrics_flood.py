"""The agent's /metrics endpoint under floods, on real loopback sockets: slow or idle
clients, however many, don't keep a scrape from being answered, and each request has one
deadline (for the whole request, not for each read)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from http import client as http_client
from pathlib import Path

import pytest
from conftest import PYTHON_SYS, as_user
from prometheus_client import CollectorRegistry, make_wsgi_app

from slurm_resilience import log
from slurm_resilience.metrics import http
from slurm_resilience.metrics.collector import AgentCollector, AgentSources


@pytest.fixture
def server() -> Iterator[http.MetricsServer]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(AgentSources(node="n1", events_path="", nccl_path="")))
    app = make_wsgi_app(registry)
    srv = http.MetricsServer("127.0.0.1", 0, app, max_connections=4, request_timeout_s=1.0,
                             write_timeout_s=5.0).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _scrape(srv: http.MetricsServer, source: str = "127.0.0.1") -> str:
    """GET /metrics from ``source`` (127.0.0.2: as a Prometheus on another host would)."""
    conn = http_client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30,
                                      source_address=(source, 0))
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read().decode()
    finally:
        conn.close()


def _until(check: object, what: str) -> None:
    deadline = time.monotonic() + 30
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_idle_connections_past_the_cap_are_evicted_and_a_scrape_is_answered(
        server: http.MetricsServer, tmp_path: Path) -> None:
    """Eight idle connections on a 4-connection endpoint: each new one evicts the oldest
    that is still sending, so the first four are closed and a scrape is answered; the log
    has one line about it, not one per connection."""
    port = server.server_address[1]
    log.configure(mode="json", level="info", file=str(tmp_path / "ev.jsonl"))
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(8)]
    try:
        _until(lambda: server.stats.evicted == 4, "the loop admitted all eight")
        log.reset()
        for s in held[:4]:
            assert s.recv(1) == b""  # closed, unanswered
        assert "slurm_resilience_agent_info" in _scrape(server)
        # The answer can reach us before the server's loop counts it (after its drain).
        _until(lambda: server.stats.served == 1, "the scrape counted as served")
        assert server.stats.evicted == 5
        assert server.stats.peak_open == 4
    finally:
        log.reset()
        for s in held:
            s.close()
    said = [json.loads(line) for line in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert [e["evicted"] for e in said if e["event"].startswith("metrics: http: cut")] == [1]


def test_a_request_trickled_line_by_line_is_cut_at_its_deadline(
        server: http.MetricsServer) -> None:
    """A client sending a header line every 0.2 s never waits out a read, yet is cut when
    the whole request's deadline passes, long before its 100 lines are sent."""
    port = server.server_address[1]
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        try:
            for _ in range(100):
                s.sendall(b"X-Slow: 1\r\n")
                sent += 1
                time.sleep(0.2)
        except OSError:
            pass  # cut: reset by the server
    assert sent < 100
    _until(lambda: server.stats.timed_out == 1, "the deadline was counted")
    assert server.in_use() == 0


def test_requests_the_endpoint_does_not_serve_get_an_answer_not_a_hang(
        server: http.MetricsServer) -> None:
    """A POST, a request with a body, a line that is not HTTP and a head over the limit are
    answered 405, 413, 400 and 431 at once, by the server itself."""
    port = server.server_address[1]

    def ask(raw: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(raw)
            return s.makefile("rb").read()

    assert ask(b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    assert ask(b"GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello").startswith(
        b"HTTP/1.1 413 ")
    assert ask(b"hello there\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    huge = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * (http.MAX_HEAD_BYTES + 1)
    assert ask(huge).startswith(b"HTTP/1.1 431 ")
    assert server.stats.bad == 4


# Keeps N connections sending one header line every 0.3 s (the attack: each read comes
# well within any per-read timeout), reopening each as it is cut, for up to 30 s or until
# stdin closes; prints "trickling" once all are open, then how many it opened in all.
TRICKLER = """
import select, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
def opened():
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(b"GET /metrics HTTP/1.1\\r\\n")
    except OSError:
        pass
    return s
conns = [opened() for _ in range(n)]
total = n
print("trickling", flush=True)
end = time.monotonic() + 30
while time.monotonic() < end and not select.select([sys.stdin], [], [], 0.3)[0]:
    for i, s in enumerate(conns):
        try:
            s.sendall(b"X-Slow: 1\\r\\n")
        except OSError:
            s.close()
            conns[i] = opened()
            total += 1
print(total, flush=True)
"""


def test_scrapes_are_answered_while_a_user_trickles_many_requests(
        server: http.MetricsServer, test_users: tuple[str, ...]) -> None:
    """An unprivileged user keeps twice the endpoint's cap of requests trickling in,
    reopened as they are cut: five scrapes in a row from another address are all
    answered meanwhile (the user's own connections are the ones evicted)."""
    port = server.server_address[1]
    attacker = subprocess.Popen([PYTHON_SYS, "-c", TRICKLER, str(port), "8"],
                                **as_user(test_users[0]), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"})
    try:
        assert attacker.stdout is not None
        assert attacker.stdout.readline().strip() == "trickling"
        _until(lambda: server.stats.evicted >= 4, "the flood filled the endpoint")
        answered = [("slurm_resilience_agent_info" in _scrape(server, "127.0.0.2"))
                    for _ in range(5)]
        assert answered == [True] * 5
    finally:
        assert attacker.stdin is not None
        attacker.stdin.close()
        attacker.wait(60)
