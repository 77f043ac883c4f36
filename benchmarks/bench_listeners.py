"""Each listener a local user can reach, under the attack that once held it, against the
listener without its fix measured in the same run:

- ``/metrics``: a scrape every 0.25 s (from 127.0.0.2, as a Prometheus on another host;
  one case from the attackers' own 127.0.0.1) while N clients each send one header line
  every ``--trickle`` seconds, reopened as they are cut. Ours: the event-loop server
  (``metrics/http.py``). Reference: the thread-per-connection server the agent used before
  (wsgiref, 8 connections, 10 s per read), reproduced below.
- exchange: an agent's messages while a user holds the listener's 64 connections idle,
  reopened as they are cut. Ours: ``privileged_ports`` on; reference: off. Munge is
  replaced by bench_exchange's STAND-IN (no authentication; delivery is what is measured).
- agent socket: 4 users hold 32 connections each, then a fifth user asks. Ours:
  ``newcomer_reserve`` 16; reference: 0.

Attackers are separate processes run as uids with no account and no privilege (60001...),
stdlib only. Needs root. Run::

    .venv/bin/python benchmarks/bench_listeners.py [--seconds 20] [--trickle 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from http import client as http_client
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from bench_exchange import StandInCredentials
from prometheus_client import CollectorRegistry, make_wsgi_app
from timing import summarise

from slurm_resilience.agent.server import AgentServer
from slurm_resilience.config.heartbeat import ExchangeSection
from slurm_resilience.hang.netrendezvous import NetworkRendezvous
from slurm_resilience.metrics import http
from slurm_resilience.metrics.collector import AgentCollector, AgentSources
from slurm_resilience.transport.wire import Kind, Message

PYTHON = "/usr/bin/python3"
ATTACKER_UID = 60001

# Holds N connections (tcp: host:port, unix: a path), sending `line` every `every` seconds
# (0: nothing), reopening each as it is cut; prints "ready", runs until stdin closes.
HOLDER = r"""
import resource, select, socket, sys, time
kind, target, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
every, line = float(sys.argv[4]), sys.argv[5].encode()
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
def opened():
    if kind == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr = target
    else:
        s = socket.socket()
        host, port = target.rsplit(":", 1)
        addr = (host, int(port))
    s.settimeout(5)
    try:
        s.connect(addr)
        s.sendall(line)
    except OSError:
        pass
    s.setblocking(False)
    return s
conns = [opened() for _ in range(n)]
print("ready", flush=True)
next_line = time.monotonic() + every
while not select.select([sys.stdin], [], [], 0.05)[0]:
    send = every > 0 and time.monotonic() >= next_line
    if send:
        next_line += every
    for i, s in enumerate(conns):
        try:
            gone = s.recv(4096) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if not gone and send:
            try:
                s.send(b"X-Slow: 1\r\n")
            except OSError:
                gone = True
        if gone:
            s.close()
            conns[i] = opened()
"""


@contextlib.contextmanager
def attack(kind: str, target: str, n: int, every: float = 0.0, line: str = "",
           uid: int = ATTACKER_UID) -> Iterator[None]:
    proc = subprocess.Popen([PYTHON, "-c", HOLDER, kind, target, str(n), str(every), line],
                            user=uid, group=uid, extra_groups=[], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)


# -- /metrics ------------------------------------------------------------------------------

class _OldHandler(WSGIRequestHandler):
    timeout = 10.0  # per read: what the slow clients beat

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


class ThreadPerConnection(ThreadingMixIn, WSGIServer):
    """REFERENCE: the agent's endpoint before (a thread each, 8 at most, 10 s per read)."""

    daemon_threads = True

    def server_activate(self) -> None:
        self.slots = threading.BoundedSemaphore(8)
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def scrapes(port: int, seconds: float, source: str) -> tuple[int, list[float]]:
    """Scrapes from address ``source`` every 0.25 s for ``seconds``: how many were tried,
    latencies of those answered."""
    tried, took = 0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tried += 1
        t0 = time.perf_counter()
        conn = http_client.HTTPConnection("127.0.0.1", port, timeout=5,
                                          source_address=(source, 0))
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            if resp.status == 200 and b"slurm_resilience_agent_info" in resp.read():
                took.append(time.perf_counter() - t0)
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.25)
    return tried, took


def metrics_case(server: str, clients: int, seconds: float, trickle: float,
                 source: str = "127.0.0.2") -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(AgentSources(node="n1", events_path="", nccl_path="")))
    app = make_wsgi_app(registry)
    if server == "ours":
        srv: Any = http.MetricsServer("127.0.0.1", 0, app).start()
        port = srv.server_address[1]
    else:
        srv = make_server("127.0.0.1", 0, app, ThreadPerConnection, handler_class=_OldHandler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        port = srv.server_address[1]
    try:
        if clients:
            with attack("tcp", f"127.0.0.1:{port}", clients, trickle,
                        "GET /metrics HTTP/1.1\r\n"):
                time.sleep(1.0)  # the clients are in
                tried, took = scrapes(port, seconds, source)
        else:
            tried, took = scrapes(port, seconds, source)
    finally:
        srv.shutdown()
        srv.server_close()
    lat = summarise(took).ms() if took else "none answered"
    where = "another address" if source != "127.0.0.1" else "their address"
    return (f"/metrics {server:9s} {clients:3d} slow clients, scraper on {where}: "
            f"{len(took)}/{tried} scrapes answered, {lat}")


# -- exchange ------------------------------------------------------------------------------

def exchange_case(privileged: bool, messages: int) -> str:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cfg = ExchangeSection(bind="127.0.0.1", ports={"b": ports[0], "c1": ports[1]},
                          addresses={"b": "127.0.0.1", "c1": "127.0.0.1"},
                          send_timeout_s=2.0, privileged_ports=privileged)
    creds = StandInCredentials()
    b = NetworkRendezvous(cfg, "b", credentials=creds)
    c1 = NetworkRendezvous(cfg, "c1", credentials=creds, listen=False)
    got: list[Message] = []
    b.on(Kind.STEPS, lambda m: got.append(m) or "")
    took = []
    try:
        with attack("tcp", f"127.0.0.1:{ports[0]}", cfg.max_connections):
            time.sleep(1.0)
            for i in range(messages):
                msg = Message(Kind.STEPS, 100 + i, 0, "c1", "b", "b", ("b", "c1"),
                              {"c1": b'{"m": 1}'})
                t0 = time.perf_counter()
                if c1.send(msg, ["b"]) == "b":
                    took.append(time.perf_counter() - t0)
    finally:
        b.close()
        c1.close()
    lat = summarise(took).ms() if took else "none delivered"
    name = "on " if privileged else "off"
    return (f"exchange privileged_ports {name}, {cfg.max_connections} held connections: "
            f"{len(got)}/{messages} messages delivered, {lat}")


# -- agent socket --------------------------------------------------------------------------

ASK = r"""
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
t0 = time.perf_counter()
s.connect(sys.argv[1])
try:
    s.sendall(b'{"op": "whoami"}\n')
except OSError:
    pass  # refused: the answer is waiting unread
line = s.makefile("rb").readline().decode().strip()
print(f"{(time.perf_counter() - t0) * 1e3:.1f} ms {line}", flush=True)
"""


def socket_case(reserve: int) -> str:
    base = Path(tempfile.mkdtemp(prefix="sr-bench-sock-", dir="/tmp"))
    base.chmod(0o755)
    srv = AgentServer(str(base / "run" / "agent.sock"), io_timeout=60, newcomer_reserve=reserve)
    srv.route("whoami", lambda req, peer: {"uid": peer.uid})
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with contextlib.ExitStack() as stack:
            for u in range(4):
                stack.enter_context(attack("unix", srv.path, 32, 0, '{"op": "whoa',
                                           uid=ATTACKER_UID + u))
            time.sleep(1.0)
            held = srv.connections()
            out = subprocess.run([PYTHON, "-c", ASK, srv.path], user=ATTACKER_UID + 4,
                                 group=ATTACKER_UID + 4, extra_groups=[], capture_output=True,
                                 text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}).stdout
    finally:
        srv.shutdown()
        srv.server_close()
        shutil.rmtree(base, ignore_errors=True)
    ms, _, answer = out.strip().partition(" ms ")
    verdict = "answered" if json.loads(answer or "{}").get("ok") else f"refused: {answer}"
    return (f"agent socket newcomer_reserve {reserve:2d}: 4 users hold {held} connections; "
            f"a fifth user is {verdict} in {ms} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0,
                   help="how long each /metrics case scrapes under attack")
    p.add_argument("--trickle", type=float, default=5.0,
                   help="seconds between the slow clients' header lines")
    p.add_argument("--messages", type=int, default=8,
                   help="agent messages sent in each exchange case")
    p.add_argument("--only", choices=("metrics", "exchange", "socket"), default=None,
                   help="run one listener's cases only")
    args = p.parse_args()
    if os.geteuid() != 0 or shutil.which(PYTHON) is None:
        print("bench_listeners: needs root (attackers run as other uids) and /usr/bin/python3")
        return 2
    if args.only in (None, "metrics"):
        print(metrics_case("ours", 0, args.seconds / 2, args.trickle))
        print(metrics_case("reference", 8, args.seconds, args.trickle))
        print(metrics_case("ours", 8, args.seconds, args.trickle))
        print(metrics_case("ours", 256, args.seconds, args.trickle))
        print(metrics_case("ours", 256, args.seconds, args.trickle, source="127.0.0.1"))
    if args.only in (None, "exchange"):
        print(exchange_case(False, args.messages))
        print(exchange_case(True, args.messages))
    if args.only in (None, "socket"):
        print(socket_case(0))
        print(socket_case(16))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
