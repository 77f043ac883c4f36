"""The agents' network exchange with a real munged: pieces fan in through the tree, and
forged, replayed or misaddressed messages, and users' own credentials, are refused."""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import PYTHON_SYS, REPO, as_user

from slurm_resilience import log
from slurm_resilience.config.heartbeat import ExchangeSection
from slurm_resilience.hang.netrendezvous import AddressBook, NetworkRendezvous
from slurm_resilience.proc import Completed
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.transport.credentials import MungeCredentials
from slurm_resilience.transport.tree import Tree
from slurm_resilience.transport.wire import LENGTH, Kind, Message, connect

MUNGED = shutil.which("munged", path="/usr/sbin:/usr/bin:/sbin:/bin")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or MUNGED is None,
                                reason="needs root and munged (package munge)")


def _free_ports(count: int) -> list[int]:
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _cfg(nodes: list[str], **kw: object) -> ExchangeSection:
    ports = dict(zip(nodes, _free_ports(len(nodes)), strict=True))
    base: dict[str, object] = {"bind": "127.0.0.1", "ports": ports,
                               "addresses": dict.fromkeys(nodes, "127.0.0.1"),
                               "send_timeout_s": 5.0, "io_timeout_s": 2.0,
                               "forward_linger_s": 0.02, "collect_after_s": 0.2}
    base.update(kw)
    return ExchangeSection(**base)  # type: ignore[arg-type]


def _agents(cfg: ExchangeSection, nodes: list[str], sock: str) -> dict[str, NetworkRendezvous]:
    return {n: NetworkRendezvous(cfg, n, credentials=MungeCredentials(socket=sock))
            for n in nodes}


def _piece(node: str) -> bytes:
    return f'{{"node": "{node}", "ranks": []}}'.encode()


def _send_raw(port: int, frame: bytes) -> str:
    """Send one frame as an agent does: from a source port below 1024 (this test is root)."""
    with connect(("127.0.0.1", port), time.monotonic() + 5, privileged=True) as s:
        s.sendall(LENGTH.pack(len(frame)) + frame)
        return s.makefile("rb").readline().decode().strip()


def test_tree_bounds_every_agents_fan_in() -> None:
    """In a 1,024-node run with fan-out 16 no node has more than 16 children, every node
    reaches the batch host, and the tree is 3 levels deep."""
    nodes = [f"n{i:04d}" for i in range(1024)]
    tree = Tree.of("n0500", nodes, 16)
    assert tree.root == "n0500" and tree.subtree("n0500") == frozenset(nodes)
    assert max(len(tree.children(n)) for n in nodes) == 16
    assert max(tree.depth(n) for n in nodes) == 3
    assert Tree.of("n0500", list(reversed(nodes)), 16) == tree


def test_pieces_fan_in_through_the_tree_to_the_batch_host(munge_socket: str) -> None:
    """Thirteen agents with fan-out 3 each publish: the batch host gathers all twelve other
    pieces, received only from its three children, over munge-authenticated TCP."""
    nodes = [f"node{i:02d}" for i in range(13)]
    cfg = _cfg(nodes, fanout=3)
    agents = _agents(cfg, nodes, munge_socket)
    try:
        for n in nodes[1:]:
            agents[n].publish(7, 0, nodes[0], nodes, _piece(n))
        got = agents[nodes[0]].gather(7, 0, nodes, time.monotonic() + 20)
        assert got == {n: _piece(n) for n in nodes[1:]}
        assert set(agents[nodes[0]].senders) <= {"node01", "node02", "node03"}
        assert {(7, 0, n) for n in nodes[1:]} == set(agents[nodes[0]].announced())
    finally:
        for a in agents.values():
            a.close()


def test_batch_host_asks_silent_nodes_to_join(munge_socket: str) -> None:
    """When a node has published nothing, the batch host's gather sends a collect request
    down the tree, which that node's agent announces so its watcher joins the incident."""
    nodes = ["b", "c1", "c2", "c3"]
    cfg = _cfg(nodes, fanout=2)
    agents = _agents(cfg, nodes, munge_socket)
    try:
        agents["c1"].publish(9, 1, "b", nodes, _piece("c1"))
        got = agents["b"].gather(9, 1, nodes, time.monotonic() + 4)
        assert set(got) == {"c1"}
        deadline = time.monotonic() + 60
        seen: set[str] = set()
        while time.monotonic() < deadline and seen != {"c2", "c3"}:
            for n in ("c2", "c3"):
                if (9, 1, "b") in {(j, r, s) for j, r, s in agents[n].announced()} or \
                        n in seen:
                    seen.add(n)
            time.sleep(0.05)
        assert seen == {"c2", "c3"}
    finally:
        for a in agents.values():
            a.close()


class _Warnings:
    """Stands in for the rendezvous module's logger: keeps the warnings' event names."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def warning(self, event: str, **_: object) -> None:
        self.events.append(event)

    def info(self, event: str, **_: object) -> None:
        pass

    error = debug = info


def test_gather_waits_only_for_the_step_nodes_not_a_launchers_spare(
        munge_socket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher's spare runs no ranks and never sends a piece: the batch host's gather
    returns once the step's nodes are in, with nothing reported missing (it waited out
    the whole rendezvous wait for the spare before)."""
    from slurm_resilience.hang import netrendezvous

    warnings = _Warnings()
    monkeypatch.setattr(netrendezvous, "log", warnings)
    nodes = ["b", "c1", "c2", "spare"]
    agents = _agents(_cfg(nodes, fanout=3), nodes, munge_socket)
    try:
        for n in ("c1", "c2"):
            agents[n].publish(12, 0, "b", nodes, _piece(n))
        got = agents["b"].gather(12, 0, nodes, time.monotonic() + 5,
                                 wait_for=["b", "c1", "c2"])
        assert got == {"c1": _piece("c1"), "c2": _piece("c2")}
        assert "exchange: gather: pieces missing at the deadline" not in warnings.events
    finally:
        for a in agents.values():
            a.close()


FORGER = """
import json, socket, struct, subprocess, sys, time, secrets
sock, port, job = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
body = {"v": 1, "kind": "pieces", "job": job, "run": 0, "from": "c1", "to": "b",
        "batch_host": "b", "nodes": ["b", "c1"], "nonce": secrets.token_hex(16),
        "time": time.time(), "pieces": {"c1": json.dumps({"forged": True})}}
cred = subprocess.run(["munge", f"--socket={sock}"], input=json.dumps(body).encode(),
                      capture_output=True, check=True).stdout.strip()
def send(frame):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(struct.pack(">I", len(frame)) + frame)
        return s.makefile("rb").readline().decode().strip()
print("forged:", send(cred))
stolen = open(sys.argv[4], "rb").read()
print("replayed:", send(stolen))
r = subprocess.run(["unmunge", f"--socket={sock}"], input=stolen, capture_output=True)
print("unmunge:", r.returncode, r.stderr.decode().strip())
"""


def test_user_forged_and_replayed_messages_are_refused(
        munge_socket: str, test_users: tuple[str, ...], tmp_path: Path) -> None:
    """An unprivileged user's own munge credential is refused (wrong uid); an agent's
    credential replayed by the user is refused by munged, and the user can't even read it
    (with privileged_ports off, so the user's messages are read at all)."""
    nodes = ["b", "c1"]
    cfg = _cfg(nodes, privileged_ports=False)
    b = NetworkRendezvous(cfg, "b", credentials=MungeCredentials(socket=munge_socket))
    creds = MungeCredentials(socket=munge_socket)
    try:
        genuine = Message(Kind.PIECES, 5, 0, "c1", "b", "b", tuple(nodes), {"c1": _piece("c1")})
        cred = creds.encode(genuine.to_payload())
        assert _send_raw(cfg.port_of("b"), cred) == "ok"
        stolen = Path(tempfile.mkdtemp(dir="/tmp")) / "stolen"
        stolen.parent.chmod(0o755)
        stolen.write_bytes(cred)
        stolen.chmod(0o644)
        pw = pwd.getpwnam(test_users[0])
        out = subprocess.run(["/usr/bin/python3", "-c", FORGER, munge_socket,
                              str(cfg.port_of("b")), "5", str(stolen)],
                             **as_user(pw.pw_uid), capture_output=True, text=True,
                             timeout=30, env={"PATH": "/usr/bin:/bin"}, check=True).stdout
        shutil.rmtree(stolen.parent)
        assert f"forged: refused: credential of uid {pw.pw_uid}, not an agent's" in out, out
        assert "replayed: refused: munge refused the credential" in out, out
        assert "Replayed credential" in out or "replay" in out.lower(), out
        assert "unmunge: " in out and "unmunge: 0" not in out, out
        assert b.gather(5, 0, nodes, time.monotonic()) == {"c1": _piece("c1")}
    finally:
        b.close()


def test_agent_credentials_bound_to_receiver_and_nonce(munge_socket: str) -> None:
    """A genuine agent message sent to another node, or a fresh credential reusing a seen
    nonce, or one for a job run the receiver is not part of, is refused and stores nothing."""
    nodes = ["b", "c1", "c2"]
    cfg = _cfg(nodes)
    agents = _agents(cfg, ["b", "c2"], munge_socket)
    creds = MungeCredentials(socket=munge_socket)
    try:
        to_b = Message(Kind.PIECES, 6, 0, "c1", "b", "b", tuple(nodes), {"c1": _piece("c1")})
        answer = _send_raw(cfg.port_of("c2"), creds.encode(to_b.to_payload()))
        assert answer == "refused: addressed to b, this is c2"
        assert _send_raw(cfg.port_of("b"), creds.encode(to_b.to_payload())) == "ok"
        again = _send_raw(cfg.port_of("b"), creds.encode(to_b.to_payload()))
        assert again == "refused: replayed nonce"
        outside = Message(Kind.PIECES, 6, 1, "c1", "b", "b", ("b", "c1"),
                          {"c2": _piece("c2")})
        assert _send_raw(cfg.port_of("b"), creds.encode(outside.to_payload())).startswith(
            "refused: c1 sent pieces of nodes outside its subtree")
        assert agents["b"].gather(6, 1, ["b", "c1"], time.monotonic()) == {}
    finally:
        for a in agents.values():
            a.close()


def test_services_add_kinds_of_their_own_and_a_side_exchange_refuses_hang_pieces(
        munge_socket: str) -> None:
    """A kind a service registered (straggler summaries) reaches its handler only after the
    same munge and binding checks; its handler's refusal is the answer; a kind nobody
    registered is refused; an exchange made for other services only (rendezvous: directory)
    refuses hang pieces; send() falls back to the next target."""
    nodes = ["b", "c1", "c2"]
    cfg = _cfg(nodes)
    b = NetworkRendezvous(cfg, "b", credentials=MungeCredentials(socket=munge_socket),
                          hang=False)
    c1 = NetworkRendezvous(cfg, "c1", credentials=MungeCredentials(socket=munge_socket))
    creds = MungeCredentials(socket=munge_socket)
    got: list[Message] = []
    try:
        named = Message(Kind.NAMED, 8, 0, "c1", "b", "b", tuple(nodes), {"b": b'{"m": 1}'})
        assert _send_raw(cfg.port_of("b"), creds.encode(named.to_payload())) == \
            "refused: no service here takes named messages"
        b.on(Kind.STEPS, lambda m: got.append(m) or ("" if m.job_id == 8 else "steps: no"))
        with pytest.raises(ValueError):
            b.on(Kind.PIECES, lambda m: "")
        steps = Message(Kind.STEPS, 8, 0, "c1", "b", "b", tuple(nodes), {"c1": b'{"m": 1}'})
        assert _send_raw(cfg.port_of("b"), creds.encode(steps.to_payload())) == "ok"
        other = Message(Kind.STEPS, 9, 0, "c1", "b", "b", tuple(nodes), {"c1": b'{"m": 1}'})
        assert _send_raw(cfg.port_of("b"), creds.encode(other.to_payload())) == \
            "refused: steps: no"
        to_c2 = Message(Kind.STEPS, 8, 0, "c1", "c2", "b", tuple(nodes), {"c1": b'{"m": 1}'})
        assert _send_raw(cfg.port_of("b"), creds.encode(to_c2.to_payload())) == \
            "refused: addressed to c2, this is b"
        assert [m.pieces for m in got] == [{"c1": b'{"m": 1}'}] * 2
        hang = Message(Kind.PIECES, 8, 0, "c1", "b", "b", tuple(nodes), {"c1": _piece("c1")})
        assert _send_raw(cfg.port_of("b"), creds.encode(hang.to_payload())) == \
            "refused: hang pieces go through the shared directory here"
        # c2 has no agent: send() gives up on it and hands the message to b.
        c1.cfg = dataclasses.replace(cfg, send_timeout_s=1.0)
        assert c1.send(steps, ["c2", "b"]) == "b"
        assert len(got) == 3 and got[-1].sender == "c1" and got[-1].receiver == "b"
    finally:
        b.close()
        c1.close()


def test_listener_caps_connections_and_cuts_slow_senders(munge_socket: str) -> None:
    """Connections past the per-peer cap are closed unread, an oversized frame is refused,
    and idle connections are cut at their deadline, so the listener is free again."""
    cfg = _cfg(["b"], max_connections_per_peer=2, io_timeout_s=0.5,
               max_message_bytes=64 << 10, max_piece_bytes=16 << 10, privileged_ports=False)
    b = NetworkRendezvous(cfg, "b", credentials=MungeCredentials(socket=munge_socket))
    assert b.listener is not None
    port = cfg.port_of("b")
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        deadline = time.monotonic() + 60
        while b.listener.stats.refused_peer_cap < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b.listener.stats.refused_peer_cap == 2 and b.listener.stats.peak_open == 2
        while b.listener.open and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b.listener.open == 0 and b.listener.stats.failed == 2
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(LENGTH.pack(1 << 20))
            assert s.makefile("rb").readline() == b""
        assert b.listener.stats.failed == 3
    finally:
        for s in idle:
            s.close()
        b.close()


# Holds N idle connections to the listener, reopening each as it is cut, for up to
# 30 s or until stdin closes; prints "holding" once the first N are open, then how many
# connections it opened in all.
HOLDER = """
import select, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
def opened():
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", port))
    except OSError:
        pass
    return s
held = [opened() for _ in range(n)]
total = n
print("holding", flush=True)
end = time.monotonic() + 30
while time.monotonic() < end:
    if select.select([sys.stdin], [], [], 0)[0]:
        break
    for i, s in enumerate(held):
        try:
            s.setblocking(False)
            gone = s.recv(1) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            s.close()
            held[i] = opened()
            total += 1
    time.sleep(0.01)
print(total, flush=True)
"""


def test_a_user_holding_connections_cant_keep_an_agents_message_out(
        munge_socket: str, test_users: tuple[str, ...], tmp_path: Path) -> None:
    """An unprivileged user keeps twice the listener's cap of idle connections open,
    reopened as they are cut: each is closed at once, unread (a source port above 1023),
    and an agent's message, sent from a port below 1024, is delivered; the log has one
    line about the user's connections, not one each."""
    nodes = ["b", "c1"]
    cfg = _cfg(nodes, max_connections=4, max_connections_per_peer=4, io_timeout_s=1.0,
               send_timeout_s=3.0)
    agents = _agents(cfg, nodes, munge_socket)
    b = agents["b"]
    assert b.listener is not None
    log.configure(mode="json", level="info", file=str(tmp_path / "ev.jsonl"))
    holder = subprocess.Popen([PYTHON_SYS, "-c", HOLDER, str(cfg.port_of("b")), "8"],
                              **as_user(test_users[0]), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        deadline = time.monotonic() + 30
        while b.listener.stats.refused_port < 8:
            assert time.monotonic() < deadline  # the listener has seen the flood
            time.sleep(0.02)
        log.reset()
        agents["c1"].publish(11, 0, "b", nodes, _piece("c1"))
        assert b.gather(11, 0, nodes, time.monotonic() + 5) == {"c1": _piece("c1")}
        assert b.senders == {"c1": 1} and b.listener.stats.failed == 0
        assert b.listener.stats.refused_cap == b.listener.stats.refused_peer_cap == 0
    finally:
        log.reset()
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(60)
        for a in agents.values():
            a.close()
    said = [json.loads(line) for line in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert [e["count"] for e in said if "source ports above 1023" in e["event"]] == [1]


def test_privileged_connect_explains_a_port_it_may_not_bind(
        test_users: tuple[str, ...]) -> None:
    """An agent not allowed a port below 1024 fails with a message that says what to do,
    not with a bare permission error."""
    probe = ("import sys, time\n"
             "from slurm_resilience.transport.wire import connect\n"
             "try:\n"
             "    connect(('127.0.0.1', 9), time.monotonic() + 5, privileged=True)\n"
             "except OSError as exc:\n"
             "    print(exc)\n")
    out = subprocess.run([PYTHON_SYS, "-c", probe], **as_user(test_users[0]),
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert "couldn't bind a source port below 1024" in out.stdout, out.stderr
    assert "privileged_ports: false" in out.stdout


class ScontrolNodes:
    """Answers ``scontrol show node <hostlist> -o`` with literal 23.02-style node lines."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def run(self, argv: list[str], *, timeout: float, check: bool = True,
            input_text: str | None = None, env: dict[str, str] | None = None) -> Completed:
        if list(argv[1:]) == ["--version"]:  # the adapter reads 22.05's text form
            return Completed(tuple(argv), 0, "slurm 22.05.8\n", "", 0.0)
        self.calls.append(list(argv))
        out = ("NodeName=gpu001 Arch=x86_64 CoresPerSocket=48 CPUAlloc=0 NodeAddr=10.1.0.1 "
               "NodeHostName=gpu001 Version=23.02.7 State=IDLE\n"
               "NodeName=gpu002 Arch=x86_64 CoresPerSocket=48 CPUAlloc=0 "
               "NodeHostName=gpu002-ib State=IDLE\n")
        return Completed(tuple(argv), 0, out, "", 0.0)


def test_peer_addresses_come_from_config_then_one_slurm_call() -> None:
    """Configured addresses win; the rest come from Slurm's NodeAddr (else NodeHostName) in
    one scontrol call, and are cached; unknown nodes stay unresolved."""
    runner = ScontrolNodes()
    adapter = SlurmAdapter(runner=runner)
    cfg = ExchangeSection(addresses={"gpu000": "10.9.9.9"}, ports={"gpu002": 7000})
    book = AddressBook(cfg, adapter.node_addresses)
    want = {"gpu000": ("10.9.9.9", 6828), "gpu001": ("10.1.0.1", 6828),
            "gpu002": ("gpu002-ib", 7000)}
    assert book.lookup(["gpu000", "gpu001", "gpu002", "gpu003"]) == want
    assert runner.calls == [["scontrol", "show", "node", "gpu[001-003]", "-o"]]
    assert book.lookup(["gpu001", "gpu002"]) == {n: want[n] for n in ("gpu001", "gpu002")}
    assert len(runner.calls) == 1


OUT_OF_FDS = """
import resource, socket, sys, time
from slurm_resilience.transport.listener import Listener
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
holder = []
listener = Listener("127.0.0.1", 0, lambda frame, peer: "ok", max_connections=1000,
                    max_per_peer=1000, io_timeout_s=30, max_frame_bytes=1024).start()
print(listener.port, flush=True)
sys.stdin.readline()
time.sleep(2)
s = listener.stats
print(s.accepted, s.paused, s.longest_pause_s, flush=True)
"""


def test_listener_pauses_instead_of_spinning_when_out_of_descriptors() -> None:
    """An agent out of file descriptors backs off between failed accepts (doubling pauses)
    instead of spinning on the connections waiting in the backlog."""
    child = subprocess.Popen([sys.executable, "-c", OUT_OF_FDS], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert child.stdin is not None and child.stdout is not None
    port = int(child.stdout.readline())
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    try:
        child.stdin.write("go\n")
        child.stdin.flush()
        accepted, paused, longest = child.stdout.readline().split()
    finally:
        for c in conns:
            c.close()
        child.kill()
        child.wait()
    assert 0 < int(accepted) < 64 and 1 <= int(paused) <= 40
    assert float(longest) >= 0.4


def test_straggler_nodes_are_judged_by_the_jobs_first_node_and_told_over_the_exchange(
        munge_socket: str, tmp_path: Path) -> None:
    """Five agents of one job (fan-out 2: n0 <- n1, n2; n1 <- n3, n4), with n3's ranks all
    30% slower: each agent's step watch summarises the job, the summaries fan in to n0 (the
    job's first node) through n1, n0 names n3 after persist_evaluations judgements and tells
    n3's agent, which records the job as a whole-node naming (the record behind
    node_straggler_recent_jobs, status and the suspect action). Clocks are injected; the
    network is real (loopback, munge)."""
    from agent_state import slot

    from slurm_resilience.config.heartbeat import HeartbeatSection
    from slurm_resilience.config.metrics import StragglerSection
    from slurm_resilience.hang import detect, jobrecord
    from slurm_resilience.hang.localpiece import JobView
    from slurm_resilience.stragglers.jobsteps import StepWatch
    from slurm_resilience.stragglers.nodeexchange import NodeExchange
    from slurm_resilience.stragglers.record import StragglerRecord
    from slurm_resilience.stragglers.synthetic import steps
    from slurm_resilience.testing import FakeClock

    nodes = ["n0", "n1", "n2", "n3", "n4"]
    cfg = _cfg(nodes, fanout=2)
    scfg = StragglerSection(window_steps=20, min_steps=10, persist_evaluations=3,
                            node_interval_s=1.0)
    clock = FakeClock(0.0, wall=1_800_000_000.0)
    rdv = {n: NetworkRendezvous(cfg, n, credentials=MungeCredentials(socket=munge_socket),
                                hang=False) for n in nodes}
    named: dict[str, list[int]] = {n: [] for n in nodes}
    watch = {n: StepWatch(lambda: scfg, n, StragglerRecord(str(tmp_path / n / "s.json")),
                          clock, lambda j, kept, n=n: named[n].append(j))
             for n in nodes}
    ex = {n: NodeExchange(lambda: scfg, n, judged=StragglerRecord(str(tmp_path / n / "j.json")),
                          clock=clock) for n in nodes}
    rec = jobrecord.JobRecord(job_id=31, uid=1000, gid=1000, user="alice", started=0.0,
                              nodes=tuple(nodes))
    rows = steps(len(nodes) * 4, 200, 5)
    try:
        for n in nodes:
            ex[n].attach(rdv[n])
        step = 0
        for _round in range(8):
            for _ in range(10):
                row = next(rows)
                step += 1
                for i, n in enumerate(nodes):
                    slots = [slot(r, step, row[i * 4 + r] * (1.3 if n == "n3" else 1), 31)
                             for r in range(4)]
                    watch[n].observe([JobView(rec, slots, detect.judge(
                        31, slots, 0.0, HeartbeatSection(),
                        alive={s.rank: True for s in slots}))])
            clock.advance(1.0)
            for n in reversed(nodes):  # leaves first; each send lands before its parent ticks
                for verdict in ex[n].tick(watch[n].local_jobs()):
                    watch[n].node_named(verdict)
                for t in list(ex[n].sending.values()):
                    t.join(30)
        assert ex["n0"].judged_now() == {31: frozenset({"n3"})}
        assert set(rdv["n0"].senders) == {"n1", "n2"}  # fan-in: only its children
        assert set(rdv["n1"].senders) <= {"n3", "n4", "n0"}
        assert named == {"n0": [], "n1": [], "n2": [], "n3": [31], "n4": []}
        [entry] = watch["n3"].record.load()
        assert (entry.job_id, entry.node, entry.user) == (31, "n3", "alice")
        assert 0.2 < entry.slowdown < 0.4
        assert 31 in watch["n3"].named_node
        assert [(e.job_id, e.node) for e in ex["n0"].judged_recent()] == [(31, "n3")]
        # A summary for the job with another node list is refused (and so is any job that
        # has no slots on the receiver).
        creds = MungeCredentials(socket=munge_socket)
        wrong = Message(Kind.STEPS, 31, 0, "n1", "n0", "n0", ("n0", "n1", "n2"),
                        {"n1": b'{"m":1,"n":20,"r":4,"s":1,"t":1}'})
        assert _send_raw(cfg.port_of("n0"), creds.encode(wrong.to_payload())) == \
            "refused: steps: nodes or judge of job 31 differ from this node's record of the job"
        # Only the job's judge may name a node.
        fake = Message(Kind.NAMED, 31, 0, "n1", "n4", "n0", tuple(nodes),
                       {"n4": b'{"m":2,"ref":1}'})
        assert _send_raw(cfg.port_of("n4"), creds.encode(fake.to_payload())) == \
            "refused: named: n1 is not job 31's judge"
    finally:
        for r in rdv.values():
            r.close()
