"""Root's log stays bounded under floods an unprivileged user makes: 4,096 mis-sized
heartbeat slots read by the real watcher, and one munge credential replayed 300 times at
a real exchange listener. Root only: real users, a real munged."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import struct
import subprocess
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import PYTHON_SYS, as_user, events_saying, logged
from prometheus_client import CollectorRegistry

from slurm_resilience.config import Config
from slurm_resilience.config.heartbeat import ExchangeSection, HeartbeatSection
from slurm_resilience.config.schema import JobTmpfsSection, NodeSection
from slurm_resilience.hang import steps
from slurm_resilience.hang.netrendezvous import NetworkRendezvous
from slurm_resilience.hang.watcher import HangWatcher
from slurm_resilience.heartbeat import paths as P
from slurm_resilience.hooks.context import HookContext
from slurm_resilience.logbudget import flush_all
from slurm_resilience.metrics import http as metrics_http
from slurm_resilience.proc import Runner, Stats
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.testing import FakeClock, FakeRunner
from slurm_resilience.transport.credentials import CredentialError, MungeCredentials

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="real users need root")

NODE = "node1"
SLOTS = 4096

# The job's user fills its run dir with slot files of the wrong size, as many as read_slots
# reads; each one is a refusal on every tick of the watcher.
_MIS_SIZED = """
import os, sys
fd = int(sys.argv[1])
for rank in range(int(sys.argv[2])):
    slot = os.open(f"hb-rank-{rank}.slot", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd)
    os.write(slot, b"x")
    os.close(slot)
"""


def test_a_users_mis_sized_slots_write_a_bounded_log(
        tmp_path: Path, events: Path, test_users: tuple[str, ...]) -> None:
    """4,096 mis-sized slots of one job, read by the watcher once a second, write 10 lines
    and one summary a minute (not 4,096 lines a tick), and the summary counts every one."""
    user = pwd.getpwnam(test_users[0])
    cfg = Config(node=NodeSection(state_dir=str(tmp_path / "state"), run_dir=str(tmp_path / "run"),
                                  job_tmpfs=JobTmpfsSection(enabled=False)),
                 heartbeat=HeartbeatSection(rendezvous="none"))
    ctx = HookContext(kind="prolog", cfg=cfg, node=NODE, env={}, job_id=12,
                      uid=user.pw_uid, gid=user.pw_gid, user=user.pw_name)
    assert steps.prolog_run_dir(ctx) == []
    jfd = os.open(P.job_dir(cfg.node.run_dir, NODE, 12), os.O_RDONLY | os.O_DIRECTORY)
    try:  # the job's processes reach their dir through the fd the test hands them
        subprocess.run([PYTHON_SYS, "-I", "-c", _MIS_SIZED, str(jfd), str(SLOTS)],
                       **as_user(user.pw_name), pass_fds=(jfd,), check=True, timeout=120)
    finally:
        os.close(jfd)
    # The watcher's clocks, moved by the test: the flood's minutes pass without a sleep.
    clock = FakeClock(time.monotonic(), wall=time.time())
    watcher = HangWatcher(cfg, NODE, SlurmAdapter(runner=FakeRunner()), clock=clock,
                          sleep=lambda s: None, config_path="")
    try:
        for _ in range(3):  # the agent's loop: tick, flush the budgets' summaries, a second
            watcher.tick()
            flush_all()
            assert len(watcher.jobs[12].errors) == SLOTS  # every slot is still refused
            clock.advance(1.0)
        clock.advance(58.0)  # reading 4,096 files is the slow part: jump to the minute's end
        flush_all()
        watcher.tick()  # the second minute starts with a fresh budget
    finally:
        watcher.close()
    lines = events_saying(events, "refused heartbeat slot")
    refusals = [e for e in lines if not e.get("summary")]
    summaries = [e for e in lines if e.get("summary")]
    assert len(refusals) == 10 + 10  # two minutes' budgets
    assert len(summaries) == 1  # the first minute's; the second is still open
    assert summaries[0]["event"] == (f"{3 * SLOTS:,} refused heartbeat slots of job 12 in "
                                     f"the last minute ({3 * SLOTS - 10:,} not logged)")
    assert all(len(e["error"]) < 300 for e in refusals)
    assert len(logged(events)) < 40  # 4 x 4,096 lines before the budget


# The user makes a credential of their own with a payload of their choosing, then sends it
# again and again to the agent's exchange port.
_REPLAYER = textwrap.dedent("""
    import socket, struct, subprocess, sys
    sock_path, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    payload = "USER-CHOSEN-" + "P" * 3000 + "-END"
    cred = subprocess.run(["munge", f"--socket={sock_path}"], input=payload.encode(),
                          capture_output=True, check=True).stdout.strip()
    answers = []
    for _ in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(struct.pack("!I", len(cred)) + cred)
            answers.append(s.makefile("rb").readline().decode().strip())
    print(len(answers), sum(a.startswith("refused:") for a in answers), answers[-1])
""")


def test_a_replayed_credential_is_decoded_once_and_logged_a_bounded_number_of_times(
        munge_socket: str, events: Path, test_users: tuple[str, ...]) -> None:
    """One user-made credential sent 300 times runs unmunge once (a replay is known by its
    digest), writes at most 10 refusals and a summary, and no line holds its payload."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ports = {"b": s.getsockname()[1]}
    # privileged_ports off: the user's replays reach the credential check (with it on they
    # are closed unread, test_exchange).
    cfg = ExchangeSection(bind="127.0.0.1", ports=ports, addresses={"b": "127.0.0.1"},
                          io_timeout_s=5.0, privileged_ports=False)
    stats = Stats()
    agent = NetworkRendezvous(cfg, "b", credentials=MungeCredentials(
        socket=munge_socket, runner=Runner(stats=stats)))
    munge = shutil.which("munge", path="/usr/bin:/bin")
    assert munge is not None
    try:
        out = subprocess.run([PYTHON_SYS, "-I", "-c", _REPLAYER, munge_socket,
                              str(ports["b"]), "300"], **as_user(test_users[0]),
                             capture_output=True, text=True, timeout=120, check=True,
                             env={"PATH": os.path.dirname(munge)}).stdout.split(maxsplit=2)
    finally:
        agent.close()
    assert out[:2] == ["300", "300"], out
    assert "Replayed credential" in out[2], out
    assert stats.calls["unmunge"] == 1
    assert sum(agent.refusals.values()) == 300
    agent.refusal_log.clock = FakeClock(real=True)
    agent.refusal_log.clock.advance(61)  # the minute has passed
    assert agent.refusal_log.flush() == 1
    assert len(events_saying(events, "refused a message")) == 10
    summary = events_saying(events, "refused messages of peer 127.0.0.1 in the last minute")
    assert [(e["count"], e["not_logged"]) for e in summary] == [(300, 290)]
    assert not any("PPPPPPPPPP" in str(e) for e in logged(events))


def test_munged_refusing_a_replay_is_named_without_the_payload(munge_socket: str) -> None:
    """unmunge prints a replayed credential's payload and no error; the refusal names the
    status (an agent restarted has no digests yet, so munged itself sees the replay)."""
    cred = MungeCredentials(socket=munge_socket).encode(b"USER-CHOSEN-" + b"P" * 3000)
    assert MungeCredentials(socket=munge_socket).decode(cred).payload.startswith(b"USER")
    with pytest.raises(CredentialError) as refused:
        MungeCredentials(socket=munge_socket).decode(cred)
    assert str(refused.value) == "munge refused the credential: Replayed credential (status 17)"


def test_connections_reset_mid_request_at_metrics_write_a_bounded_log(
        events: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Connections reset halfway through their request headers write no traceback and no
    line each (the old socketserver printed one per connection); the endpoint still
    answers a scrape after them."""
    server = metrics_http.serve("127.0.0.1", 0, CollectorRegistry())
    port = server.server_address[1]
    try:
        for _ in range(20):  # the headers never end: the server is reading when the reset comes
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        deadline = time.monotonic() + 30
        while server.in_use() and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the server to see the resets, not timing it
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            assert resp.status == 200
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capfd.readouterr().err
    assert len(events_saying(events, "metrics: http")) <= 1  # at most the minute's summary
