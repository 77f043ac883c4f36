"""The agent under a connection flood from an unprivileged user: others are still served."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import as_user

from slurm_resilience.agent import client
from slurm_resilience.agent.server import AgentServer

SYSTEM_PYTHON = "/usr/bin/python3"  # stdlib only: the test users need nothing of ours

# Opens N connections, starts a request on each and never finishes it, holds them all.
FLOOD = """
import resource, socket, sys
path, n = sys.argv[1], int(sys.argv[2])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held = 0
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    try:
        s.connect(path)
        s.send(b'{"op": "whoa')
        held += 1
    except OSError:
        pass
    socks.append(s)
print(held, flush=True)
sys.stdin.read()
"""

ASK = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect(sys.argv[1])
s.sendall(b'{"op": "whoami"}\\n')
print(s.makefile("rb").readline().decode().strip(), flush=True)
"""

PER_UID = 8
TOTAL = 32


@pytest.fixture
def agent() -> Iterator[AgentServer]:
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} missing")
    base = Path(tempfile.mkdtemp(prefix="sr-flood-", dir="/tmp"))
    base.chmod(0o755)
    srv = AgentServer(str(base / "run" / "agent.sock"), io_timeout=120, max_per_uid=PER_UID,
                      max_connections=TOTAL)
    srv.route("whoami", lambda req, peer: {"uid": peer.uid})
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    shutil.rmtree(base, ignore_errors=True)


def test_a_flood_from_one_user_does_not_shut_out_another(
        agent: AgentServer, test_users: tuple[str, ...]) -> None:
    """Three processes of one unprivileged user hold 1,000 slow connections each; another
    user's request and root's are still answered, and the agent's threads stay under the cap."""
    flooder, other = test_users
    threads = threading.active_count()
    floods = [subprocess.Popen([SYSTEM_PYTHON, "-c", FLOOD, agent.path, "1000"],
                               **as_user(flooder), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True) for _ in range(3)]
    try:
        held = []
        for proc in floods:  # each has made its 1,000 tries
            assert proc.stdout is not None
            held.append(int(proc.stdout.readline()))
        # The flood holds connections. One flooder may hold none: once the others fill the
        # listen queue faster than a loaded host accepts and refuses, its connects fail.
        assert sum(held) > 0, held
        ask = subprocess.run([SYSTEM_PYTHON, "-c", ASK, agent.path], **as_user(other),
                             capture_output=True, text=True, timeout=60, check=True)
        assert json.loads(ask.stdout) == {"ok": True, "uid": pwd.getpwnam(other).pw_uid}
        assert client.call(agent.path, "whoami", timeout=30) == {"ok": True, "uid": 0}
        # The flooder's slots and one in flight, not a thread per connection.
        assert threading.active_count() - threads <= PER_UID + 1
        assert agent.stats.peak_connections <= PER_UID + 2
        assert agent.stats.busy > 0
    finally:
        for proc in floods:
            proc.kill()
            proc.wait()


def test_a_flooders_slots_come_back_when_it_goes(agent: AgentServer,
                                                 test_users: tuple[str, ...]) -> None:
    """Once the flooder is gone its slots are free again: the same user is served."""
    flooder, _ = test_users
    proc = subprocess.Popen([SYSTEM_PYTHON, "-c", FLOOD, agent.path, "200"], **as_user(flooder),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and int(proc.stdout.readline()) > 0
    proc.kill()
    proc.wait()
    done = threading.Event()
    for _ in range(3000):  # the server notices the closed connections on its own
        if agent.connections() == 0:
            break
        done.wait(0.01)
    ask = subprocess.run([SYSTEM_PYTHON, "-c", ASK, agent.path], **as_user(flooder),
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(ask.stdout)["ok"]


def test_users_with_connections_open_leave_the_newcomer_reserve_free(
        test_users: tuple[str, ...]) -> None:
    """When users' floods hold every slot they may (here one user allowed the whole total,
    as four users of 32 fill 128), a user with no connection open and root are still
    answered: the last slots are kept for them."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} missing")
    flooder, other = test_users
    base = Path(tempfile.mkdtemp(prefix="sr-flood-", dir="/tmp"))
    base.chmod(0o755)
    srv = AgentServer(str(base / "run" / "agent.sock"), io_timeout=120, max_per_uid=TOTAL,
                      max_connections=TOTAL, newcomer_reserve=4, root_reserve=0)
    srv.route("whoami", lambda req, peer: {"uid": peer.uid})
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    flood = subprocess.Popen([SYSTEM_PYTHON, "-c", FLOOD, srv.path, str(TOTAL + 8)],
                             **as_user(flooder), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert flood.stdout is not None and int(flood.stdout.readline()) > 0
        done = threading.Event()
        for _ in range(3000):  # the accept loop admits or refuses the whole flood
            if srv.stats.admitted + srv.stats.busy >= TOTAL + 8:
                break
            done.wait(0.01)
        assert srv.connections() == TOTAL - 4 and srv.stats.busy == 12
        ask = subprocess.run([SYSTEM_PYTHON, "-c", ASK, srv.path], **as_user(other),
                             capture_output=True, text=True, timeout=60, check=True)
        assert json.loads(ask.stdout) == {"ok": True, "uid": pwd.getpwnam(other).pw_uid}
        assert client.call(srv.path, "whoami", timeout=30) == {"ok": True, "uid": 0}
    finally:
        flood.kill()
        flood.wait()
        srv.shutdown()
        srv.server_close()
        shutil.rmtree(base, ignore_errors=True)
