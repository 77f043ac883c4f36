"""The agent's socket server, client and service loop, on a real unix socket."""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import events_saying

from slurm_resilience.agent import client, daemon
from slurm_resilience.agent.daemon import Agent, bind_server
from slurm_resilience.agent.server import AgentServer
from slurm_resilience.agent.service import AgentContext, Handler, Peer, RequestError
from slurm_resilience.config import Config, load_text
from slurm_resilience.slurm.adapter import SlurmAdapter


@pytest.fixture
def server(tmp_path: Path) -> Iterator[AgentServer]:
    srv = AgentServer(str(tmp_path / "run" / "agent.sock"), max_bytes=4096)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_handler_sees_kernel_verified_peer(server: AgentServer) -> None:
    """Handlers receive the caller's real uid and pid from SO_PEERCRED."""
    seen: list[Peer] = []

    def whoami(req: dict[str, object], peer: Peer) -> dict[str, object]:
        seen.append(peer)
        return {"uid": peer.uid}

    server.route("whoami", whoami)
    answer = client.call(server.path, "whoami")
    assert answer == {"ok": True, "uid": os.getuid()}
    assert seen[0].pid == os.getpid()


def test_refusal_reaches_client(server: AgentServer) -> None:
    """A RequestError becomes a refusal with its message on the client side."""

    def deny(req: dict[str, object], peer: Peer) -> dict[str, object]:
        raise RequestError(f"job 7 belongs to uid 1001, not {peer.uid}")

    server.route("act", deny)
    with pytest.raises(client.AgentRefused, match="belongs to uid 1001"):
        client.call(server.path, "act", job_id=7)


@pytest.mark.parametrize(("args", "error"), [
    ({"job_id": True}, "job_id must be a non-negative integer, got 'True'"),
    ({"job_id": 7.9}, "job_id must be a non-negative integer, got '7.9'"),
    ({"job_id": -3}, "job_id must be a non-negative integer"),
    ({"job_id": [7]}, "job_id must be a non-negative integer"),
    ({"job_id": "7", "user": 5}, "user must be a string, got '5'"),
    ({"job_id": 7, "user": "u" * 300}, "user is longer than 256 characters"),
])
def test_request_fields_are_checked_by_type(server: AgentServer, args: dict[str, object],
                                            error: str) -> None:
    """A request's fields are typed before use: a bool, a float or a list is never taken
    for a job id (int(True) would be job 1), and strings are bounded."""
    from slurm_resilience.agent.service import Request, int_arg, str_arg

    def job(req: Request, peer: Peer) -> dict[str, object]:
        return {"job_id": int_arg(req, "job_id"),
                "user": str_arg(req, "user", default="", limit=256)}

    server.route("job", job)
    with pytest.raises(client.AgentRefused, match=error.replace("[", r"\[")):
        client.call(server.path, "job", **args)
    assert client.call(server.path, "job", job_id="12") == {"ok": True, "job_id": 12,
                                                           "user": ""}


def test_unknown_op_and_garbage_are_refused(server: AgentServer) -> None:
    """Unknown ops list the known ones; oversized requests are refused, not read."""
    server.route("known", lambda req, peer: {})
    with pytest.raises(client.AgentRefused, match="unknown op 'nope'; known: known"):
        client.call(server.path, "nope")
    with pytest.raises(client.AgentRefused, match="larger than 4096"):
        client.call(server.path, "known", blob="x" * 5000)


def test_crashing_handler_does_not_kill_server(server: AgentServer) -> None:
    """A handler bug is an error answer, and the server keeps serving."""

    def boom(req: dict[str, object], peer: Peer) -> dict[str, object]:
        raise KeyError("bug")

    server.route("boom", boom)
    with pytest.raises(client.AgentRefused, match="internal error: KeyError"):
        client.call(server.path, "boom")
    assert client.call(server.path, "ping")["ok"]


def test_missing_socket_is_unavailable(tmp_path: Path) -> None:
    """Calling an agent that is not running raises AgentUnavailable."""
    with pytest.raises(client.AgentUnavailable, match="couldn't reach"):
        client.call(str(tmp_path / "none.sock"), "ping", timeout=0.5)


def _start(srv: AgentServer) -> threading.Thread:
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    return thread


def _until(condition: Callable[[], bool]) -> None:
    """Wait for another thread to get somewhere (bounded, no timing asserted)."""
    done = threading.Event()
    for _ in range(3000):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition never became true")


def _stop(srv: AgentServer) -> None:
    srv.shutdown()
    srv.server_close()


def test_a_request_not_whole_by_the_deadline_is_cut(tmp_path: Path) -> None:
    """A client that starts a request and never ends it is answered and closed at the
    per-connection deadline, its slot given back."""
    srv = AgentServer(str(tmp_path / "run" / "a.sock"), io_timeout=0.2)
    _start(srv)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(srv.path)
            sock.sendall(b'{"op": "pi')
            answer = json.loads(sock.makefile("rb").readline())
        assert answer == {"ok": False,
                          "error": "agent: couldn't read request: not complete within 0.2s"}
        assert srv.stats.timed_out == 1
        assert client.call(srv.path, "ping")["ok"]
    finally:
        _stop(srv)


def test_connections_over_the_cap_are_answered_busy_without_a_thread(tmp_path: Path) -> None:
    """Past the cap a connection is told 'busy' and closed at once: no thread, no wait; the
    client sees the agent as unavailable (the caller's fallback)."""
    srv = AgentServer(str(tmp_path / "run" / "a.sock"), io_timeout=60, max_connections=2,
                      root_reserve=1)
    _start(srv)
    held = []
    try:
        for _ in range(3):  # root: 2 slots + 1 of its reserve, each holding a thread
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(srv.path)
            held.append(sock)
        _until(lambda: srv.connections() == 3)
        threads = threading.active_count()
        for _ in range(5):
            with pytest.raises(client.AgentUnavailable, match=r"busy: \d+ connections in all "
                                                              r"\(cap 3\)"):
                client.call(srv.path, "ping", timeout=0.1)  # retried until its timeout
        assert threading.active_count() == threads
        assert srv.stats.busy >= 5 and srv.stats.peak_connections == 3
        held.pop().close()  # a slot comes free: a waiting caller gets in
        assert client.call(srv.path, "ping", timeout=30)["ok"]
    finally:
        for sock in held:
            sock.close()
        _stop(srv)


class _Exhausted:
    """A listening socket whose accept() fails as at the fd limit."""

    def __init__(self) -> None:
        self.accepts = 0

    def accept(self) -> tuple[socket.socket, str]:
        self.accepts += 1
        raise OSError(errno.EMFILE, "Too many open files")


def test_fd_exhaustion_backs_off_instead_of_spinning(tmp_path: Path) -> None:
    """Out of fds, each failed accept pauses accepting longer (up to 1 s) and is logged
    once, not once per try; a successful accept resets the pause."""
    srv = AgentServer(str(tmp_path / "run" / "a.sock"))
    real = srv.socket
    fake = _Exhausted()
    srv.socket = fake  # type: ignore[assignment]
    try:
        pauses = [srv.accept_one() for _ in range(7)]
    finally:
        srv.socket = real
    assert pauses == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert fake.accepts == 7 and srv.stats.accept_errors == 7
    assert srv.connection_log.stats().lines == 1
    _start(srv)
    try:
        assert client.call(srv.path, "ping")["ok"]
        assert srv._backoff == 0.0
    finally:
        _stop(srv)


def test_two_services_cannot_claim_one_op(server: AgentServer) -> None:
    """Routing the same op twice is a startup error."""
    server.route("x", lambda req, peer: {})
    with pytest.raises(ValueError, match="two services answer op 'x'"):
        server.route("x", lambda req, peer: {})


class _Counter:
    name = "counter"
    interval_s = 0.0

    def __init__(self) -> None:
        self.ticks = 0
        self.closed = False

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks == 2:
            raise RuntimeError("a bad tick must not stop the loop")

    def handlers(self) -> dict[str, Handler]:
        return {"count": lambda req, peer: {"ticks": self.ticks}}

    def close(self) -> None:
        self.closed = True


def test_agent_ticks_services_and_serves_their_ops(tmp_path: Path) -> None:
    """The agent ticks each service, survives a failing tick, answers ops and closes cleanly."""
    cfg = load_text(Config, f"agent:\n  socket: {tmp_path}/{{node}}.sock\n  tick_s: 0.05\n")
    svc = _Counter()
    agent = Agent(AgentContext(cfg, "node1", SlurmAdapter()), [svc])
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            if svc.ticks >= 3:
                break
            threading.Event().wait(0.05)
        answer = client.call(str(tmp_path / "node1.sock"), "count")
        assert answer["ticks"] >= 3
    finally:
        agent.stop_event.set()
        thread.join(5)
    assert svc.closed


def test_a_request_sent_while_services_start_is_answered_once_the_agent_runs(
        tmp_path: Path) -> None:
    """The socket listens before any service starts (the hook server, the first of them,
    runs prologs that call it): a request sent then waits in the kernel's queue and is
    answered, instead of finding no socket."""
    cfg = load_text(Config, f"agent:\n  socket: {tmp_path}/{{node}}.sock\n  tick_s: 0.05\n")
    ctx = AgentContext(cfg, "node1", SlurmAdapter())
    server = bind_server(ctx)
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.settimeout(10)
    early.connect(str(tmp_path / "node1.sock"))  # no service yet, no accept loop
    early.sendall(json.dumps({"op": "count"}).encode() + b"\n")
    svc = _Counter()
    agent = Agent(ctx, [svc], server)  # the services started
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        answer = json.loads(early.makefile("rb").readline())
        assert answer["ok"] and isinstance(answer["ticks"], int)
    finally:
        early.close()
        agent.stop_event.set()
        thread.join(5)


class _Slow(_Counter):
    name = "slow"

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock = clock

    def tick(self) -> None:
        self.clock[0] += 6.0  # six seconds pass in this tick

    def handlers(self) -> dict[str, Handler]:
        return {}


def test_a_slow_tick_is_said_with_its_service(tmp_path: Path, events: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every service waits on the one loop (the warning ahead of a time limit too): a tick
    longer than SLOW_TICK_S is logged with the service that took it."""
    clock = [1000.0]
    monkeypatch.setattr(daemon.time, "monotonic", lambda: clock[0])
    cfg = load_text(Config, f"agent:\n  socket: {tmp_path}/{{node}}.sock\n")
    agent = Agent(AgentContext(cfg, "node1", SlurmAdapter()), [_Counter(), _Slow(clock)])
    try:
        agent.tick_once()
    finally:
        agent.server.server_close()
    said = events_saying(events, "service tick was slow")
    assert [(e["service"], e["seconds"]) for e in said] == [("slow", 6.0)]


class _Stuck:
    """A looped service whose tick blocks until released (a Slurm call at its timeout)."""

    name = "stuck"
    interval_s = 0.0

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def tick(self) -> None:
        self.entered.set()
        self.release.wait(30)

    def handlers(self) -> dict[str, Handler]:
        return {}

    def close(self) -> None:
        self.release.set()


class _Deadline(_Stuck):
    name = "deadline"
    own_thread = True

    def tick(self) -> None:
        if self.release.is_set():  # set by the test once the loop is stuck
            self.entered.set()


def test_a_service_with_a_deadline_ticks_while_the_loop_is_stuck(tmp_path: Path) -> None:
    """The limits service's warning must not wait for another service's slow tick: a
    service with own_thread ticks on its own thread while the loop's tick blocks."""
    cfg = load_text(Config, f"agent:\n  socket: {tmp_path}/{{node}}.sock\n  tick_s: 0.05\n")
    stuck, deadline = _Stuck(), _Deadline()
    agent = Agent(AgentContext(cfg, "node1", SlurmAdapter()), [stuck, deadline])
    assert agent.looped == [stuck] and agent.own_thread == [deadline]
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        assert stuck.entered.wait(30)
        deadline.release.set()  # from here on its tick says it ran
        assert deadline.entered.wait(30)
        assert not stuck.release.is_set()  # the loop is still inside its stuck tick
    finally:
        agent.stop_event.set()
        stuck.release.set()
        thread.join(30)
    assert not thread.is_alive()
