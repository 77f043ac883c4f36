"""Start and stop the sandbox's daemons, tracked by pid files.

A pid file alone is not trusted: before signalling, the process's
``/proc/<pid>/cmdline`` must name the expected program and mention this
sandbox's state directory, so a recycled pid of some other process is never
killed. Daemons that fork themselves (munged, slurmctld, slurmd) write their own
pid files; the others are started here in their own session and their pid
file is written for them.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from slurm_resilience import proc
from slurm_resilience.log import get_logger
from slurm_resilience.sandbox import sweep
from slurm_resilience.sandbox.errors import failed

log = get_logger("sandbox")

# Children started by this process, kept so they are reaped (no zombies, no ResourceWarning).
_CHILDREN: dict[int, proc.Child[bytes]] = {}


@dataclass(frozen=True)
class Daemon:
    """One process of the sandbox: its program, pid file, and how to recognise it."""

    name: str
    program: str
    pid_file: Path
    marker: str

    def pid(self) -> int | None:
        """The pid from the pid file when that process is alive and really ours."""
        pid = read_pid(self.pid_file)
        if pid is None or not alive(pid):
            return None
        return pid if matches(pid, self.program, self.marker) else None


def exited(daemon: Daemon) -> bool:
    """Whether the daemon named by an existing pid file has exited since it wrote it.

    Only liveness is asked, not the command line: a child started here shows our own
    command line until its exec, which must not read as "exited"."""
    pid = read_pid(daemon.pid_file)
    if pid is None:
        # Missing, or created and not yet written (slurmd opens its pid file, then writes
        # the pid): still starting, not exited; the caller's wait has its own deadline.
        return False
    child = _CHILDREN.get(pid)
    if child is not None:
        return child.poll() is not None
    return not alive(pid)


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def cmdline(pid: int) -> list[str]:
    """The process's argv, or [] when it is gone (or a kernel thread)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    reap(pid)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # The state letter follows the parenthesised command name, which may contain spaces.
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X")


def matches(pid: int, program: str, marker: str) -> bool:
    """Whether ``pid`` runs ``program`` with ``marker`` (our state dir, as a whole path:
    never ``/tmp/sbx10`` for ``/tmp/sbx1``) among its arguments."""
    argv = cmdline(pid)
    if not argv:
        return False
    names = {os.path.basename(argv[0])}
    if len(argv) > 1:  # interpreters: "python -m …", the program is further along
        names.update(os.path.basename(a) for a in argv[1:3])
    return program in names and any(sweep.names_path_in(a, marker) for a in argv)


def reap(pid: int) -> None:
    """Collect the exit status of our own finished child, if ``pid`` is one."""
    child = _CHILDREN.get(pid)
    if child is not None and child.poll() is not None:
        del _CHILDREN[pid]


def reap_all() -> None:
    """Collect every finished child started here (after ``down``)."""
    for pid in list(_CHILDREN):
        reap(pid)


def spawn(argv: Sequence[str], *, log_file: Path, pid_file: Path,
          env: Mapping[str, str]) -> int:
    """Start a foreground daemon in its own session, logging to ``log_file``."""
    with open(log_file, "ab") as out:
        child = proc.spawn(argv, stdout=out, stderr=proc.STDOUT, env=env)
    _CHILDREN[child.pid] = child
    pid_file.write_text(f"{child.pid}\n")
    return child.pid


def start_forking(argv: Sequence[str], *, env: Mapping[str, str], log_file: Path,
                  name: str = "", logs: Sequence[Path] = (), timeout: float = 20.0) -> None:
    """Run a daemon that forks itself; returns once its starting process has exited.

    Raises SandboxError naming the daemon (``name``, else the program) with the last
    lines of ``log_file`` and ``logs`` (its own log file) when it fails or hangs.
    """
    name = name or os.path.basename(argv[0])
    with open(log_file, "ab") as out:
        try:
            child = proc.spawn(argv, stdout=out, stderr=proc.STDOUT, env=env)
        except OSError as exc:
            raise failed(name, f"couldn't be started: {exc}", [log_file, *logs]) from exc
        _CHILDREN[child.pid] = child
        try:
            rc = child.wait(timeout=timeout)
        except proc.TimeoutExpired:
            child.kill()
            child.wait()
            raise failed(name, f"did not finish starting within {timeout:g}s",
                         [log_file, *logs]) from None
        finally:
            reap(child.pid)
    if rc != 0:
        raise failed(name, f"did not start: exit status {rc}", [log_file, *logs])


def stop(daemon: Daemon, *, grace: float = 5.0) -> bool:
    """TERM the daemon, KILL it after ``grace`` seconds; True when something was stopped."""
    return bool(stop_all([daemon], grace=grace))


def stop_all(group: Sequence[Daemon], *, grace: float = 5.0) -> list[str]:
    """Stop several daemons at once (TERM, then KILL after ``grace``); returns the names of
    those that were running."""
    pids: dict[int, Daemon] = {}
    for daemon in group:
        pid = daemon.pid()
        if pid is None:
            daemon.pid_file.unlink(missing_ok=True)
        else:
            pids[pid] = daemon
            _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid, daemon in pids.items():
        if alive(pid) and matches(pid, daemon.program, daemon.marker):
            log.warning("daemon ignored SIGTERM; killing", daemon=daemon.name, pid=pid)
            _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for daemon in pids.values():
        daemon.pid_file.unlink(missing_ok=True)
    return [d.name for d in pids.values()]


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return


def wait_for(predicate_path: Path, timeout: float) -> bool:
    """Wait until ``predicate_path`` exists."""
    deadline = time.monotonic() + timeout
    while not predicate_path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def wait_listening(path: Path, timeout: float) -> bool:
    """Wait until a Unix socket at ``path`` accepts a connection. Its file alone says
    nothing: one left by a daemon killed outright outlives it."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            try:
                sock.connect(str(path))
                return True
            except OSError:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
