"""The hook server: a hook handed to a warm process runs exactly as in its own, on the
hook's own streams, with its exit status; refusals and a missing server fall back to the
hook's own process and say why; only root reaches the socket; a vanished worker is
reported, not re-run; the server ends with its agent; the agent restarts it."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import events_saying, logged

from slurm_resilience.hooks import client, endpoint, server, supervisor
from slurm_resilience.procstat import read_proc
from slurm_resilience.sandbox import faults, hardware, resilience_conf
from slurm_resilience.sandbox.layout import Layout
from slurm_resilience.testing import FakeClock

NODE = "node1"
PYTHON = sys.executable


@dataclass
class Node:
    state: Path
    config: Path
    sockets: Path
    events: Path
    env: dict[str, str]

    def socket(self) -> str:
        return endpoint.socket_path(os.path.realpath(self.config), NODE, str(self.sockets))


@pytest.fixture
def node(tmp_path: Path) -> Node:
    """One sandbox node's stand-in hardware and configuration, no Slurm: a prolog that
    finds the node healthy runs every step and exits 0 without calling Slurm."""
    layout = Layout(state_dir=tmp_path / "state", nodes=1, leaves=1)
    hardware.prepare_node_hardware(layout.state_dir, [NODE])
    sections = resilience_conf.sections(layout)
    events = tmp_path / "events.jsonl"
    sections["logging"] = {"file": str(events), "syslog": False, "level": "info"}
    # No per-job tmpfs: this test is about who runs the hook, not the run directory.
    sections.setdefault("node", {})["job_tmpfs"] = {"enabled": False}
    # A drain has no slurmctld to reach here: fail it fast.
    sections.setdefault("slurm", {})["timeout_s"] = 0.5
    cfg = tmp_path / "slurm-resilience.yaml"
    cfg.write_text(yaml.safe_dump(sections))
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_RESILIENCE_CONFIG": str(cfg),
           "SLURMD_NODENAME": NODE, "SLURM_JOB_ID": "4242", "SLURM_JOB_UID": "0",
           "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7",
           "SLURM_JOB_NODELIST": NODE}
    return Node(layout.state_dir, cfg, tmp_path / "socks", events, env)


def _server_argv(node: Node, ready_fd: int) -> list[str]:
    return [PYTHON, "-I", "-m", "slurm_resilience.hooks.server", "--config", str(node.config),
            "--node", NODE, "--socket-dir", str(node.sockets), "--ready-fd", str(ready_fd)]


def _start(node: Node) -> subprocess.Popen[bytes]:
    """The server, once it listens (it says so on a pipe; a server that dies closes it)."""
    r, w = os.pipe()
    proc = subprocess.Popen(_server_argv(node, w), pass_fds=(w,))
    os.close(w)
    with os.fdopen(r) as ready:
        line = ready.readline()
    assert line == "ready\n", f"hook server did not listen (exit {proc.poll()})"
    return proc


@pytest.fixture
def served(node: Node) -> Iterator[subprocess.Popen[bytes]]:
    proc = _start(node)
    yield proc
    proc.terminate()
    proc.wait(10)


def _run(node: Node, kind: str = "prolog") -> client.Outcome:
    return client.run(kind, [], node.env, str(node.config), NODE, str(node.sockets))


def test_served_prolog_runs_every_step_in_a_worker(node: Node, served: object) -> None:
    out = _run(node)
    assert (out.rc, out.started, out.why) == (0, True, "")
    ok = events_saying(node.events, "hook ok")
    assert len(ok) == 1 and ok[0]["hook"] == "prolog" and ok[0]["job_id"] == 4242
    assert ok[0].get("pid") != os.getpid()
    assert not events_saying(node.events, "own process")


def test_served_prolog_fails_with_the_hooks_status(node: Node, served: object) -> None:
    """A missing GPU: the worker's prolog exits 1 (it would drain; no Slurm here, so the
    drain itself fails and is logged), and the hook gets that 1."""
    faults.inject(node.state, NODE, "gpu-missing:3")
    out = _run(node)
    assert (out.rc, out.started) == (1, True)
    assert events_saying(node.events, "couldn't drain node")


def test_worker_writes_to_the_hooks_own_stderr(node: Node, served: object,
                                               tmp_path: Path) -> None:
    """The config broke after the server read it: the worker reads it again and says so on
    the stderr the hook was given (slurmd's log), exactly as the hook itself would."""
    node.config.write_text("hooks: {prolog_timeout_s: -5}\n")
    code = (f"import sys; sys.path.insert(0, {str(Path.cwd())!r})\n"
            "from slurm_resilience.hooks import client\n"
            f"o = client.run('prolog', [], {node.env!r}, {str(node.config)!r}, {NODE!r}, "
            f"{str(node.sockets)!r})\n"
            "print('rc', o.rc, o.started)\n")
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "rc 0 True", done.stderr
    assert "slurm-resilience prolog:" in done.stderr and "prolog_timeout_s" in done.stderr


def test_a_hook_from_another_mount_namespace_runs_itself_and_says_why(
        node: Node, served: object) -> None:
    """As a hook inside a unit with private mounts would be: the server refuses it (its
    run-dir tmpfs would be mounted where the job can't see it), nothing ran there, and
    the hook is told why, so it runs in its own process."""
    code = ("from slurm_resilience.hooks import client\n"
            f"o = client.run('prolog', [], {node.env!r}, {str(node.config)!r}, {NODE!r}, "
            f"{str(node.sockets)!r})\n"
            "print(o.rc, o.started, o.why)\n")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", PYTHON, "-c",
                           code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("None False hook server refused: the hook is in another "
                                  "mount namespace"), done.stdout
    assert not events_saying(node.events, "hook ok")


def test_without_a_server_the_hook_runs_itself_and_says_why(node: Node) -> None:
    out = _run(node)
    assert out.rc is None and "no hook server at" in out.why and "disagree" not in out.why
    env = {**node.env}
    done = subprocess.run([PYTHON, "-I", "-m", "slurm_resilience.hooks", "prolog"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = events_saying(node.events, "hook runs in its own process")
    assert said and "hook server" in said[0]["why"] and said[0]["level"] == "info"
    assert events_saying(node.events, "hook ok")


def test_a_server_under_another_node_name_is_named(node: Node) -> None:
    """The hook's SLURMD_NODENAME and the server's node name disagree: every hook on the
    node would run in its own process. The hook names the servers it does see for its
    configuration (which on a host of several slurmds may be other nodes' own)."""
    argv = _server_argv(node, -1)
    argv[argv.index("--node") + 1] = "node1-ib"
    r, w = os.pipe()
    proc = subprocess.Popen([*argv[:-1], str(w)], pass_fds=(w,))
    os.close(w)
    try:
        with os.fdopen(r) as ready:
            assert ready.readline() == "ready\n"
        out = _run(node)
        assert out.rc is None
        assert "servers here listen as node node1-ib" in out.why
        assert "node name 'node1' (SLURMD_NODENAME)" in out.why and "disagree" in out.why
    finally:
        proc.terminate()
        proc.wait(10)


def test_only_root_reaches_the_socket(node: Node, served: object,
                                      test_users: tuple[str, ...]) -> None:
    """The server's directory is 0700 root: a user can't even connect, so no user can
    have root run a hook with an environment of theirs."""
    st = os.stat(node.sockets)
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)
    code = ("import socket,sys\ns=socket.socket(socket.AF_UNIX)\n"
            f"try:\n s.connect({node.socket()!r}); print('connected')\n"
            "except PermissionError: print('denied')\n")
    done = subprocess.run(["runuser", "-u", test_users[0], "--", PYTHON, "-I", "-c", code],
                          capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "denied", done.stderr


def test_a_killed_worker_is_reported_not_rerun(node: Node, served: subprocess.Popen[bytes]
                                               ) -> None:
    """A worker killed mid-hook: the hook says so and applies the failure policy (fail-open:
    exit 0) without running the steps again, which may have acted already."""
    scenario = hardware.locate(node.state, NODE).scenario
    doc = json.loads(scenario.read_text())
    doc["hang"] = {"function": "nvmlDeviceGetCount", "seconds": 10}
    scenario.write_text(json.dumps(doc))
    result: dict[str, client.Outcome] = {}
    t = threading.Thread(target=lambda: result.setdefault("out", _run(node)))
    t.start()
    # No event marks the fork from out here: look for the worker among the server's children.
    workers: list[int] = []
    deadline = time.monotonic() + 30
    while not workers and time.monotonic() < deadline:
        workers = _children(served.pid)
        time.sleep(0.05)
    assert workers, "no worker appeared"
    os.kill(workers[0], signal.SIGKILL)
    t.join(60)
    out = result["out"]
    assert (out.rc, out.started) == (client.LOST, True)
    assert "killed by signal 9" in out.why
    from slurm_resilience.hooks import runner

    assert runner.worker_lost("prolog", node.env, out.why) == 0
    lost = [e for e in logged(node.events) if "without an exit status" in str(e["event"])]
    assert lost and lost[0]["level"] == "error"
    assert len(events_saying(node.events, "hook ok")) == 0


def _children(pid: int) -> list[int]:
    procs = (read_proc(int(p)) for p in os.listdir("/proc") if p.isdigit())
    return [p.pid for p in procs if p is not None and p.ppid == pid]


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_server_ends_with_its_agent(node: Node) -> None:
    """Started by a parent that then dies (an agent SIGKILLed): the server notices, stops
    and takes its socket with it."""
    # The stand-in agent starts the server on its own stdout (our pipe), waits until it
    # listens, then sits until killed; our pipe's end then comes with the server's end.
    code = ("import os,signal,subprocess\nr,w=os.pipe()\n"
            f"p=subprocess.Popen({_server_argv(node, -1)[:-1]!r}+[str(w)],pass_fds=(w,))\n"
            "os.close(w)\nassert os.fdopen(r).readline()=='ready\\n'\n"
            "print(p.pid, flush=True)\nsignal.pause()\n")
    parent = subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    # A pidfd turns readable when the server has exited: the pipe's EOF alone comes while
    # the kernel is still tearing the process down (seen as state R in CI).
    server_gone = os.pidfd_open(pid)
    try:
        assert os.path.exists(node.socket())
        parent.kill()
        parent.wait()
        assert parent.stdout.read() == ""  # EOF: the server, which held the pipe, is ending
        # The generous wait is a liveness deadline (a server that never ends), not a bound.
        ended, _, _ = select.select([server_gone], [], [], 120)
        assert ended, f"the server outlived its agent (state {_state(pid)!r})"
    finally:
        os.close(server_gone)
    assert not os.path.exists(node.socket())


def _hand_over(node: Node) -> socket.socket:
    """A hook's first half, by hand: the request and streams sent, ``started`` read."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(node.socket())
    request = json.dumps({"v": endpoint.VERSION, "kind": "prolog", "argv": [],
                          "env": node.env, "cwd": "/", "umask": 0o022,
                          "config": os.path.realpath(node.config)}).encode()
    with open(os.devnull, "r+b") as null:
        fds = [null.fileno()] * 3
        payload = endpoint.frame(request)
        sent = socket.send_fds(sock, [payload], fds)
        sock.sendall(payload[sent:])
    assert sock.recv(64) == b"started\n"
    return sock


def test_a_hook_that_gives_up_after_started_is_never_run_by_its_worker(
        node: Node, served: object) -> None:
    """The hook's wait ran out just as the server said ``started``: it runs itself and
    sends no go, so the worker must not run the steps too."""
    sock = _hand_over(node)
    sock.shutdown(socket.SHUT_WR)  # gone, as far as the worker can tell; we still hear it
    with sock:
        assert sock.recv(4096).startswith(b"abandoned: the hook closed the connection")
    said = events_saying(node.events, "without running the hook")[0]
    assert "gave up waiting" in said["why"]
    assert not events_saying(node.events, "hook ok")
    assert _run(node).rc == 0  # the server serves the next hook as usual
    assert len(events_saying(node.events, "hook ok")) == 1


def test_the_worker_waits_only_for_an_exact_go() -> None:
    for sent, says in [(b"go\n", ""), (b"", "no go from the hook within 0.05s"),
                       (b"no\n", "expected go"), (None, "closed the connection")]:
        hook, worker = socket.socketpair()
        if sent is None:
            hook.close()
        else:
            hook.sendall(sent)
        why = server._await_go(worker, 0.05)
        assert says in why if says else why == "", (sent, why)
        worker.close()
        if sent is not None:
            hook.close()


def test_a_late_go_is_answered_abandoned_and_the_hook_runs_itself(tmp_path: Path) -> None:
    """A worker that stopped waiting says so; the hook knows nothing ran and runs itself
    (a stand-in server on the socket's path: the real one's wait is 5 s)."""
    sockets = tmp_path / "socks"
    sockets.mkdir(mode=0o700)
    cfg = tmp_path / "c.yaml"
    path = endpoint.socket_path(os.path.realpath(cfg), NODE, str(sockets))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    heard: list[bytes] = []

    def stand_in() -> None:
        conn, _ = listener.accept()
        with conn:
            socket.recv_fds(conn, 65536, 3)
            conn.sendall(b"started\n")
            heard.append(conn.recv(16))
            conn.sendall(b"abandoned: no go from the hook within 5s\n")

    t = threading.Thread(target=stand_in)
    t.start()
    out = client.run("prolog", [], {"A": "b"}, str(cfg), NODE, str(sockets))
    t.join(30)
    listener.close()
    assert heard == [endpoint.GO]
    assert (out.rc, out.started) == (None, False)
    assert "abandoned: no go from the hook within 5s" in out.why


# -- the server's decisions, without a process ------------------------------------------

def _request(**changes: object) -> bytes:
    doc: dict[str, object] = {"v": endpoint.VERSION, "kind": "prolog", "argv": [],
                              "env": {"A": "b"}, "cwd": "/", "umask": 0o022, "config": "/c"}
    doc.update(changes)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("changes, says", [
    ({"v": 0}, "version"), ({"kind": "rm -rf"}, "unknown hook kind"),
    ({"argv": ["x"] * 17}, "argv"), ({"env": {"A": 1}}, "env"), ({"cwd": "rel"}, "cwd"),
    ({"umask": True}, "umask"), ({"config": None}, "config"),
])
def test_requests_are_checked_field_by_field(changes: dict[str, object], says: str) -> None:
    with pytest.raises(server.Refused, match=says):
        server.parse_request(_request(**changes))
    with pytest.raises(server.Refused, match="JSON"):
        server.parse_request(b"{not json")


def _server(tmp_path: Path, **kw: object) -> server.HookServer:
    pkg = tmp_path / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "a.py").write_text("x = 1\n")
    return server.HookServer(str(tmp_path / "s.sock"), str(tmp_path / "c.yaml"),
                             parent_pid=os.getppid(), package_dir=str(pkg), **kw)  # type: ignore[arg-type]


def test_an_upgrade_makes_the_server_step_aside(tmp_path: Path) -> None:
    srv = _server(tmp_path, code_check_s=0.0)
    req = server.parse_request(_request())
    srv._admit(req, os.getpid(), [0, 1, 2])
    (tmp_path / "pkg" / "b.py").write_text("y = 2\n")
    with pytest.raises(server.Refused, match="stale"):
        srv._admit(req, os.getpid(), [0, 1, 2])
    assert srv.stopping


def test_a_full_server_refuses_and_the_hook_runs_itself(tmp_path: Path) -> None:
    srv = _server(tmp_path, max_workers=0)
    with pytest.raises(server.Refused, match="busy"):
        srv._admit(server.parse_request(_request()), os.getpid(), [0, 1, 2])
    with pytest.raises(server.Refused, match="3 standard streams"):
        _server(tmp_path)._admit(server.parse_request(_request()), os.getpid(), [0])


def test_a_hook_in_another_mount_namespace_is_refused(tmp_path: Path) -> None:
    """Its run-dir tmpfs would be mounted where the job can't see it."""
    # It says "in" from inside the new namespace, then becomes the process we name.
    other = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                              "echo in; exec sleep 60"], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "in\n"
        assert server._mount_ns(str(other.pid)) != server._mount_ns("self")
        with pytest.raises(server.Refused, match="mount namespace"):
            _server(tmp_path)._admit(server.parse_request(_request()), other.pid, [0, 1, 2])
    finally:
        other.kill()
        other.wait()


def test_socket_names_separate_nodes_and_files() -> None:
    a = endpoint.socket_path("/etc/a.yaml", "node1")
    assert a != endpoint.socket_path("/etc/b.yaml", "node1")
    assert a != endpoint.socket_path("/etc/a.yaml", "node2")
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError):
            endpoint.socket_path("/etc/a.yaml", bad)


def test_agent_restarts_a_server_that_exits_with_backoff() -> None:
    clock = FakeClock(100.0)
    svc = supervisor.HookServerService(["sh", "-c", "exit 3"], clock=clock)
    svc.start()
    assert svc.proc is not None
    svc.proc.wait()
    svc.tick()  # noticed: restart in 1 s
    assert svc.proc is None and svc.starts == 1
    clock.advance(1.0)
    svc.tick()
    assert svc.starts == 2 and svc.proc is not None
    svc.proc.wait()
    svc.tick()
    clock.advance(1.5)
    svc.tick()
    assert svc.starts == 2  # the second wait is 2 s
    clock.advance(0.5)
    svc.tick()
    assert svc.starts == 3
    svc.close()
