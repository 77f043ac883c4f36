"""The hook server: runs prologs, epilogs and health checks in workers forked from a
process that has already loaded the configuration and every step's modules.

Most of a hook's time in its own process goes to starting Python, importing the
configuration schema and the checks, and parsing the YAML; the checks themselves take a
few tens of milliseconds. Each node runs one server (``slurm-resilience-hooks.service``,
or the agent starts it: ``hooks.server``), and a hook (``hooks/client.py``) hands it its
environment and its stdin, stdout and stderr; a forked worker runs exactly what the hook
would have run (``runner.main``), writing to the hook's own streams, and sends the exit
status itself, so a server that stops meanwhile loses nothing; the server reports a
worker killed before it could.

Only root connects: the socket sits in a 0700 root directory and every peer's uid is
checked (SO_PEERCRED). A worker runs in the server's mount namespace, so a hook from
another one (a unit with private mounts, say) is refused and runs itself: a job's run-dir
tmpfs must be mounted where the job sees it. The server is single-threaded, so forking
is safe; it bounds the workers it runs at once, the time and size of a request, and
stops when the agent that started it is gone or its own code changed on disk (an
upgrade), answering ``stale`` so the hook runs in its own process until a new server
is started (systemd's ``Restart=``, or the agent).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import selectors
import signal
import socket
import stat
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slurm_resilience import config, log
from slurm_resilience.config import Config, lastgood
from slurm_resilience.config.health import NVML_MODULES
from slurm_resilience.config.paths import node_name
from slurm_resilience.hooks import endpoint, runner, steps
from slurm_resilience.logbudget import LogBudget

REQUEST_TIMEOUT_S = 2.0
# How often the package's files are looked at for an upgrade (stat of ~200 files: a few
# ms, too much for every hook); a hook within this long of an upgrade runs the old code.
CODE_CHECK_S = 2.0
MAX_WORKERS = 64
POLL_S = 0.5
_UCRED = struct.Struct("3i")

logger = log.get_logger("hooks", hook="server")
# Out of descriptors, accept fails on every poll: a few lines and a summary a minute.
_ACCEPT_LOG = LogBudget(logger, "failed accepts or requests not received", lines=3)


class Refused(Exception):
    """A request the server will not run; the text goes back as ``refused: ...``."""


@dataclass(frozen=True)
class Request:
    kind: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    umask: int
    config: str


def parse_request(raw: bytes) -> Request:
    """Pure: the JSON a hook sent, every field checked."""
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise Refused(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != endpoint.VERSION:
        raise Refused(f"expected a version {endpoint.VERSION} request")
    kind, argv, env = doc.get("kind"), doc.get("argv"), doc.get("env")
    if kind not in endpoint.KINDS:
        raise Refused(f"unknown hook kind {str(kind)[:20]!r}")
    if not (isinstance(argv, list) and len(argv) <= 16
            and all(isinstance(a, str) and len(a) <= 4096 for a in argv)):
        raise Refused("argv must be at most 16 strings")
    if not (isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise Refused("env must map strings to strings")
    cwd, umask, cfg = doc.get("cwd"), doc.get("umask"), doc.get("config")
    if not (isinstance(cwd, str) and cwd.startswith("/")):
        raise Refused("cwd must be an absolute path")
    if not (isinstance(umask, int) and not isinstance(umask, bool) and 0 <= umask <= 0o777):
        raise Refused("umask must be 0..0o777")
    if not isinstance(cfg, str):
        raise Refused("config must be a path")
    return Request(kind, argv, env, cwd, umask, cfg)


def code_signature(package_dir: str) -> tuple[int, int]:
    """(newest mtime, count) of the package's Python files: an upgrade changes it."""
    newest, count = 0, 0
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                with contextlib.suppress(OSError):
                    newest = max(newest, os.stat(os.path.join(root, name)).st_mtime_ns)
                    count += 1
    return newest, count


def warm(cfg: Config | None) -> list[str]:
    """Import what any hook may run, so no worker imports it again: every step module,
    the gate's checks and collectors, the NVML binding (or its stand-in)."""
    names = {spec.partition(":")[0] for kinds in (steps.PROLOG, steps.EPILOG, steps.HEALTHCHECK)
             for spec in kinds}
    names.add("slurm_resilience.health.gate")
    for package in ("slurm_resilience.health.checks", "slurm_resilience.health.collectors"):
        mod = importlib.import_module(package)
        names.update(f"{package}.{m.name}" for m in pkgutil.iter_modules(mod.__path__))
    names.add("slurm_resilience.slurm.adapter")
    if cfg is not None and cfg.health.backend != "nvml":
        names.add(NVML_MODULES[cfg.health.backend])
    failed = []
    for name in sorted(names):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a worker imports it itself, and says why
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    with contextlib.suppress(ImportError):
        importlib.import_module("pynvml")
    return failed


def _stat_key(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class ConfigCache:
    """The server's configuration, read again when the file changed (by its stat)."""

    path: str
    key: tuple[int, ...] | None = None
    cfg: Config | None = None

    def get(self) -> Config | None:
        key = _stat_key(self.path)
        if key is None or key != self.key:
            loaded = lastgood.load(self.path)  # refreshes the last good copy
            # A file that does not load: each worker loads it again, gates with the last
            # good copy and reports the error as the hook would.
            self.cfg = loaded.cfg if loaded.valid else None
            if not loaded.valid:
                logger.error("hook server: config: couldn't load; hooks gate with "
                             f"{loaded.gating_with}", **loaded.fields())
            self.key = key
        return self.cfg


@dataclass
class HookServer:
    socket_path: str
    config_path: str
    parent_pid: int
    max_workers: int = MAX_WORKERS
    workers: dict[int, socket.socket] = field(default_factory=dict)
    stopping: bool = False
    package_dir: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code_check_s: float = CODE_CHECK_S
    configs: ConfigCache | None = None
    go_timeout_s: float = endpoint.GO_TIMEOUT_S

    def __post_init__(self) -> None:
        self.real_config = os.path.realpath(self.config_path)
        if self.configs is None:
            self.configs = ConfigCache(self.config_path)
        self.signature = code_signature(self.package_dir)
        self._code_checked = time.monotonic()
        self.mount_ns = _mount_ns("self")
        self.listener: socket.socket | None = None
        self._inode = 0
        self._wake: tuple[int, ...] = ()

    # -- socket ------------------------------------------------------------------------

    def bind(self) -> None:
        """Listen at ``socket_path`` in a root-only directory; a live server there wins."""
        directory = os.path.dirname(self.socket_path)
        os.makedirs(os.path.dirname(directory), mode=0o755, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise RuntimeError(f"{directory} must be a directory of uid {os.geteuid()} "
                               f"with mode 0700 (is {stat.filemode(st.st_mode)}, "
                               f"uid {st.st_uid})")
        if os.path.lexists(self.socket_path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(self.socket_path)
                raise RuntimeError(f"another hook server answers at {self.socket_path}")
            except OSError:
                os.unlink(self.socket_path)  # left by a server that died
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.socket_path)
        os.chmod(self.socket_path, 0o600)
        sock.listen(64)
        sock.setblocking(False)
        self.listener = sock
        self._inode = os.lstat(self.socket_path).st_ino

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            with contextlib.suppress(OSError):
                if os.lstat(self.socket_path).st_ino == self._inode:
                    os.unlink(self.socket_path)  # still ours, not a successor's

    # -- loop --------------------------------------------------------------------------

    def serve(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Accept hooks and report their workers' ends until told to stop or orphaned.
        A worker's end wakes the loop at once (SIGCHLD through a self-pipe)."""
        assert self.listener is not None
        wake_r, wake_w = os.pipe()
        for fd in (wake_r, wake_w):
            os.set_blocking(fd, False)
        previous = signal.signal(signal.SIGCHLD, lambda *_: None)
        old_wakeup = signal.set_wakeup_fd(wake_w)
        self._wake = (wake_r, wake_w)
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, "accept")
        sel.register(wake_r, selectors.EVENT_READ, "wake")
        try:
            while not (self.stopping or should_stop()):
                if os.getppid() != self.parent_pid:
                    logger.warning("hook server: its agent is gone; stopping")
                    break
                for key, _ in sel.select(POLL_S):
                    if key.data == "accept":
                        self._accept()
                    else:
                        with contextlib.suppress(BlockingIOError):
                            os.read(wake_r, 4096)
                self.reap()
        finally:
            signal.set_wakeup_fd(old_wakeup)
            signal.signal(signal.SIGCHLD, previous)
            sel.close()
            self.close()
            # Workers still running tell their hooks the status themselves.
            for conn in self.workers.values():
                conn.close()
            self.workers.clear()
            os.close(wake_r)
            os.close(wake_w)

    def reap(self) -> None:
        """Tell each ended worker's hook its exit status, which the worker normally sent
        already (the hook reads the first); a killed worker could not: ``lost``."""
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.workers.pop(pid, None)
            if conn is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            _answer(conn, f"rc {code}" if code >= 0 else
                    f"lost: the worker was killed by signal {-code}")
            conn.close()

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of fds: the hook runs itself; don't spin
            _ACCEPT_LOG.log(exc.errno, "hook server: accept failed", error=str(exc))
            time.sleep(0.05)
            return
        fds: list[int] = []
        try:
            conn.settimeout(REQUEST_TIMEOUT_S)
            pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        _UCRED.size))
            if uid != 0:
                raise Refused(f"uid {uid} is not root")
            raw, fds = _receive(conn)
            request = parse_request(raw)
            self._admit(request, pid, fds)
        except Refused as exc:
            _answer(conn, f"refused: {exc}")
            _close_fds(fds)
            conn.close()
            return
        except OSError as exc:
            _ACCEPT_LOG.log(exc.errno, "hook server: request not received", error=str(exc))
            _close_fds(fds)
            conn.close()
            return
        assert self.configs is not None
        cfg = self.configs.get() if request.config == self.real_config else None
        go_r, go_w = os.pipe()
        worker = os.fork()
        if worker == 0:
            os.close(go_w)
            _work(go_r, conn, fds, request, cfg, self._child_fds(), pid,  # never returns
                  self.go_timeout_s)
        os.close(go_r)
        _close_fds(fds)
        # A hook that gave up before "started" runs itself and this worker never runs; one
        # that gives up after it sends no go, and the worker never runs either.
        started = _answer(conn, "started")
        os.write(go_w, b"g" if started else b"x")
        os.close(go_w)
        if started:
            self.workers[worker] = conn
        else:
            conn.close()

    def _child_fds(self) -> list[int]:
        out = list(self._wake)
        if self.listener is not None:
            out.append(self.listener.fileno())
        return out

    def _admit(self, request: Request, peer_pid: int, fds: list[int]) -> None:
        if len(fds) != 3:
            raise Refused(f"expected the hook's 3 standard streams, got {len(fds)} fds")
        if self.code_changed():
            self.stopping = True
            raise Refused("stale: the package changed on disk since the server started")
        if _mount_ns(str(peer_pid)) != self.mount_ns:
            raise Refused("the hook is in another mount namespace than the server")
        if len(self.workers) >= self.max_workers:
            raise Refused(f"busy: {len(self.workers)} hooks running")

    def code_changed(self) -> bool:
        now = time.monotonic()
        if now - self._code_checked < self.code_check_s:
            return False
        self._code_checked = now
        return code_signature(self.package_dir) != self.signature


def _mount_ns(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


def _receive(conn: socket.socket) -> tuple[bytes, list[int]]:
    """One length-prefixed frame and the fds sent with its first bytes."""
    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    fds = list(fds)
    buf = bytearray(data)
    if len(buf) < endpoint.HEADER_BYTES:
        raise Refused("request too short")
    size = int.from_bytes(buf[:endpoint.HEADER_BYTES], "big")
    if size > endpoint.MAX_REQUEST_BYTES:
        raise Refused(f"request of {size} bytes (at most {endpoint.MAX_REQUEST_BYTES})")
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while len(buf) < endpoint.HEADER_BYTES + size:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = conn.recv(65536)
        if not chunk:
            raise Refused("request cut short")
        buf += chunk
    return bytes(buf[endpoint.HEADER_BYTES:endpoint.HEADER_BYTES + size]), fds


def _answer(conn: socket.socket, line: str) -> bool:
    """Send a line; False when the hook is gone (never SIGPIPE, which a worker takes as
    a hook would)."""
    try:
        conn.sendall(line.encode("utf-8", "replace")[:4000] + b"\n", socket.MSG_NOSIGNAL)
        return True
    except OSError:
        return False


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _await_go(conn: socket.socket, timeout_s: float) -> str:
    """The hook's commitment to be served; empty when it came, else why not."""
    deadline = time.monotonic() + timeout_s
    got = b""
    try:
        while len(got) < len(endpoint.GO) and time.monotonic() < deadline:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = conn.recv(len(endpoint.GO) - len(got))
            if not chunk:
                return "the hook closed the connection before its go (it gave up waiting)"
            got += chunk
    except TimeoutError:
        pass
    except OSError as exc:
        return f"reading the hook's go: {exc}"
    if got == endpoint.GO:
        return ""
    if len(got) < len(endpoint.GO):
        return f"no go from the hook within {timeout_s:g}s"
    return f"expected go from the hook, got {got!r}"


def _work(go: int, conn: socket.socket, fds: list[int], request: Request, cfg: Config | None,
          server_fds: list[int], hook_pid: int, go_timeout_s: float) -> None:
    """The forked worker: wait for the server's go, become the hook (its streams,
    directory, umask, environment), run it and send its status, which is also the
    worker's exit status (the server reports that if the worker dies first). Never
    returns."""
    code = 1

    def finish(status: int) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        _answer(conn, f"rc {status}")
        os._exit(status)

    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        _close_fds(server_fds)
        if os.read(go, 1) != b"g":
            os._exit(0)  # the hook gave up waiting and runs itself
        os.close(go)
        why = _await_go(conn, go_timeout_s)
        if why:
            # The hook runs itself (or is gone): nothing ran here, and it is told so (after
            # the log line) if it is still listening.
            logger.info("hook server: worker ends without running the hook", why=why,
                        kind=request.kind, hook_pid=hook_pid)
            _answer(conn, f"abandoned: {why}")
            os._exit(0)
        conn.settimeout(REQUEST_TIMEOUT_S)  # bounds the status write, not the hook
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        _close_fds([fd for fd in fds if fd > 2])
        try:
            os.chdir(request.cwd)
        except OSError:
            os.chdir("/")
        os.umask(request.umask)
        os.environ.clear()
        os.environ.update(request.env)
        sys.argv = ["slurm_resilience.hooks", request.kind, *request.argv]
        code = runner.main(request.kind, request.argv, request.env,  # type: ignore[arg-type]
                           cfg=cfg, exit=finish, hook_pid=hook_pid)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a hook: status 1
        with contextlib.suppress(Exception):
            traceback.print_exc()
        code = 1
    finish(code)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurm_resilience.hooks.server",
                                description="serve this node's hooks from a warm process "
                                            "(started by the agent)")
    p.add_argument("--config", default=None,
                   help="the configuration file the hooks load (default: found as they find "
                        "it: $SLURM_RESILIENCE_CONFIG, beside $SLURM_CONF, /etc)")
    p.add_argument("--node", default="", help="this node's Slurm name (default: node.name "
                                              "from the config, then the short host name)")
    p.add_argument("--socket-dir", default=endpoint.SOCKET_DIR,
                   help="root-only directory of the servers' sockets (tests)")
    p.add_argument("--ready-fd", type=int, default=None, metavar="FD",
                   help="write 'ready' to this inherited fd once listening, then close it "
                        "(a supervisor or test waits on it instead of polling)")
    args = p.parse_args(argv)
    path, _ = config.resolve_path(args.config)
    configs = ConfigCache(path)
    configs.get()
    # A file that does not load: its node name and logging come from the last good copy,
    # which is what the workers gate with.
    cfg = lastgood.load(path).cfg
    node = node_name(args.node or cfg.node.name)
    server = HookServer(endpoint.socket_path(os.path.realpath(path), node, args.socket_dir),
                        path, parent_pid=os.getppid(), configs=configs)
    log.configure(mode="json", level=cfg.logging.level, file=cfg.logging.file,
                  use_syslog=cfg.logging.syslog, node=node)
    failed = warm(cfg)
    stop: dict[str, Any] = {"now": False}

    def on_term(signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        server.bind()
    except (OSError, RuntimeError) as exc:
        logger.error("hook server: couldn't listen", socket=server.socket_path, error=str(exc))
        return 1
    logger.info("hook server listening", socket=server.socket_path, config=path,
                not_imported=failed or None)
    if args.ready_fd is not None:
        os.write(args.ready_fd, b"ready\n")
        os.close(args.ready_fd)
    server.serve(lambda: bool(stop["now"]))
    logger.info("hook server stopped", workers_running=len(server.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
