"""The agent's socket server, client and service loop, on a real unix socket."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_resilience.agent import client
from slurm_resilience.agent.daemon import Agent
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
