"""Cross-node hang blame without a shared directory: the agents exchange their observations
over munge-authenticated TCP (heartbeat.exchange), and a user can neither forge nor replay
a message. Run with ``-s`` to see the decision time."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PYTHON_SYS, as_user
from hang_jobs import TRAIN, output, submit, wait_for_decision

from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.transport.credentials import MungeCredentials
from slurm_resilience.transport.wire import Kind, Message

pytestmark = [pytest.mark.sandbox, pytest.mark.slow,
              pytest.mark.skipif(not TRAIN.exists(), reason="needs examples/train.py")]


def _exchange_log(sandbox: Sandbox, job_id: int) -> list[dict[str, object]]:
    path = sandbox.state_dir / "log" / "slurm-resilience.jsonl"
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if "exchange: received pieces" in line:
            event = json.loads(line)
            if event.get("job_id") == job_id:
                out.append(event)
    return out


def _modes(sandbox: Sandbox) -> dict[str, str]:
    """Each node's rendezvous mode as its agent last rebuilt it (none logged: the sandbox's
    directory mode it started with)."""
    path = sandbox.state_dir / "log" / "slurm-resilience.jsonl"
    modes = {node: "directory" for node in sandbox.nodes}
    for line in path.read_text(errors="replace").splitlines():
        if "rendezvous rebuilt after a reload" in line:
            event = json.loads(line)
            modes[str(event.get("node"))] = str(event.get("mode"))
    return modes


def _network_mode(sandbox: Sandbox) -> None:
    """Switch the sandbox's agents from the shared directory to the network exchange, and
    wait until every agent has rebuilt its rendezvous in network mode (they reload on their
    next tick; the previous test's reset may have put them back in directory mode) and its
    listener accepts connections. A connection alone proves nothing: in directory mode the
    agents listen on the same port for straggler summaries."""
    sandbox.update_resilience_config({"heartbeat": {"rendezvous": "network",
                                                    "rendezvous_dir": None}})
    deadline = time.monotonic() + 60
    while any(mode != "network" for mode in _modes(sandbox).values()):
        assert time.monotonic() < deadline, f"agents never switched: {_modes(sandbox)}"
        time.sleep(0.2)
    for i in range(1, len(sandbox.nodes) + 1):
        while True:
            try:
                socket.create_connection(("127.0.0.1", sandbox.layout.agent_port(i)),
                                         timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"agent {i}'s exchange never listened"
                time.sleep(0.2)


def test_stall_on_a_non_batch_node_is_blamed_over_the_network(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """With no rendezvous_dir, rank 1 stalling on the second node is blamed on that node by
    the batch host, from the piece the second node's agent sent over the exchange."""
    _network_mode(sandbox)
    user = test_users[0]
    work = sandbox.user_dir(user, "hangnet")
    job_id = submit(sandbox, user, work, "--steps 400 --ckpt-every 5 --hang-at-step 12 "
                                         "--hang-rank 1")
    report = wait_for_decision(sandbox, work, job_id)
    sandbox.run(["scancel", str(job_id)])
    out = output(work, job_id)
    node_line = re.search(r"rank 1 running step=1 at=[\d.]+ restarts=0 node=(\w+)", out)
    assert node_line and isinstance(report, dict), out
    stalled = node_line.group(1)
    batch_host = report["node"]
    assert stalled != batch_host
    assert report["blame"]["nodes"] == [stalled], report["blame"]
    assert "stalled first" in report["blame"]["explanation"], report["blame"]
    assert "no observations from" not in report["blame"]["explanation"]
    assert set(report["evidence"]) == {batch_host, stalled}
    received = _exchange_log(sandbox, job_id)
    assert any(e.get("sender") == stalled for e in received), received
    timings = report["timings"]
    acted = timings.get("action_at")  # the plan's requeue step, once it ran
    hang = re.search(r"rank 1 hanging at step=12 at=([\d.]+)", out)
    if acted is not None:
        since_hang = f", hang -> requeue issued {acted - float(hang.group(1)):.1f}s" if hang else ""
        print(f"\nnetwork exchange: detected -> requeue issued "
              f"{float(acted) - float(report['detected_at']):.2f}s on the batch host (evidence "
              f"{timings['evidence_s']:.2f}s of it){since_hang}")


FORGER = """
import json, secrets, socket, struct, subprocess, sys, time
munge_socket, port, batch, other, stolen = sys.argv[1:6]
body = {"v": 1, "kind": "pieces", "job": 999999, "run": 0, "from": other, "to": batch,
        "batch_host": batch, "nodes": [batch, other], "nonce": secrets.token_hex(16),
        "time": time.time(), "pieces": {other: json.dumps({"node": other, "forged": True})}}
cred = subprocess.run(["munge", f"--socket={munge_socket}"], input=json.dumps(body).encode(),
                      capture_output=True, check=True).stdout.strip()
def send(frame):
    try:
        with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as s:
            s.sendall(struct.pack(">I", len(frame)) + frame)
            return s.makefile("rb").readline().decode().strip() or "(closed unread)"
    except OSError as exc:
        return f"(closed unread: {exc})"
print("forged:", send(cred))
print("replayed:", send(open(stolen, "rb").read()))
"""


# Holds 128 idle connections to a port (twice the listener's cap), reopening each as it
# is cut, until stdin closes (at most 120 s); prints "holding" once all are open.
HOLDER = """
import select, socket, sys, time
port = int(sys.argv[1])
def opened():
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", port))
    except OSError:
        pass
    s.setblocking(False)
    return s
held = [opened() for _ in range(128)]
print("holding", flush=True)
end = time.monotonic() + 120
while time.monotonic() < end and not select.select([sys.stdin], [], [], 0.05)[0]:
    for i, s in enumerate(held):
        try:
            gone = s.recv(1) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            s.close()
            held[i] = opened()
"""


def test_user_cannot_forge_or_replay_exchange_messages(
        sandbox: Sandbox, test_users: tuple[str, ...]) -> None:
    """Root's message from a port below 1024 is accepted while another user holds 128
    connections to the listener; a user's, from the only ports a user may bind, is closed
    unread, whether it carries the user's own munge credential or an agent's replayed
    (munge's own refusals are shown in tests/unit/test_exchange.py)."""
    _network_mode(sandbox)
    batch, other = sandbox.nodes[0], sandbox.nodes[1]
    port = sandbox.layout.agent_port(1)
    creds = MungeCredentials(socket=str(sandbox.layout.munge_socket))
    genuine = Message(Kind.PIECES, 999998, 0, other, batch, batch, (batch, other),
                      {other: json.dumps({"node": other}).encode()})
    stolen = sandbox.user_dir(test_users[0], "stolen") / "cred"
    stolen.write_bytes(creds.encode(genuine.to_payload()))
    stolen.chmod(0o644)
    holder = subprocess.Popen([PYTHON_SYS, "-c", HOLDER, str(port)], **as_user(test_users[1]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={"PATH": "/usr/bin:/bin"})
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    try:
        probe = _as_agent(sandbox, port, stolen)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(60)
    assert probe.strip() == "ok", probe
    out = sandbox.run(["/usr/bin/python3", "-c", FORGER, str(sandbox.layout.munge_socket),
                       str(port), batch, other, str(stolen)], user=test_users[1],
                      timeout=60).stdout
    assert "forged: (closed unread" in out, out
    assert "replayed: (closed unread" in out, out


def _as_agent(sandbox: Sandbox, port: int, frame: Path) -> str:
    """Root sends ``frame`` as an agent does, from a port below 1024; the answer."""
    return sandbox.run(["python3", "-c", "import socket,struct,sys\n"
                        "f=open(sys.argv[2],'rb').read()\n"
                        "for p in range(1023,511,-1):\n"  # as an agent: a port below 1024
                        "    s=socket.socket()\n"
                        "    try:\n"
                        "        s.bind(('127.0.0.1',p)); break\n"
                        "    except OSError:\n"
                        "        s.close()\n"
                        "s.connect(('127.0.0.1',int(sys.argv[1])))\n"
                        "s.sendall(struct.pack('>I',len(f))+f)\n"
                        "print(s.makefile('rb').readline().decode().strip())",
                        str(port), str(frame)], timeout=30).stdout
