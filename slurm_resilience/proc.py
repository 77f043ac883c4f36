"""The one place that runs external programs.

Every call is an argv list with ``shell=False`` and a mandatory timeout, and is
counted, so callers (the Slurm adapter, collectors, the sandbox) share one
audited seam. Tests of callers replace :class:`Runner` with a stateful fake.
Children that outlive the call (daemons, detached verifiers, the hook server, NCCL
ranks) are started with :func:`spawn`: also an argv list, never a shell, stdin from
``/dev/null``, counted; their owner waits for them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from slurm_resilience.log import get_logger

log = get_logger("proc")


@dataclass(frozen=True)
class Completed:
    """The outcome of one finished command."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class CommandError(Exception):
    """A command could not be started, timed out, or exited non-zero."""

    def __init__(self, argv: Sequence[str], message: str, result: Completed | None = None):
        self.argv = tuple(argv)
        self.result = result
        super().__init__(f"{argv[0]}: {message}")


class CommandTimeout(CommandError):
    """A command ran past its timeout and was killed."""


@dataclass
class Stats:
    """Counters per program name: calls, failures, timeouts."""

    calls: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    timeouts: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, name: str, *, failed: bool = False, timed_out: bool = False) -> None:
        with self.lock:
            self.calls[name] += 1
            if failed:
                self.failures[name] += 1
            if timed_out:
                self.timeouts[name] += 1


STATS = Stats()

# What callers of ``spawn`` handle, so none of them imports subprocess itself.
Child = subprocess.Popen
TimeoutExpired = subprocess.TimeoutExpired
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT
Output = int | IO[bytes] | None  # DEVNULL, STDOUT (stderr only), a file, or None: inherit


def spawn(argv: Sequence[str], *, stdout: Output = DEVNULL, stderr: Output = DEVNULL,
          env: Mapping[str, str] | None = None, cwd: str | None = None,
          executable: str | None = None, new_session: bool = True,
          stats: Stats = STATS) -> subprocess.Popen[bytes]:
    """Start a child that outlives this call (its owner waits for it, or it is detached
    with ``new_session``): an argv list, no shell, stdin from /dev/null, no inherited fds.
    Raises OSError when it can't be started."""
    if not argv:
        raise ValueError("proc.spawn: empty argv")
    name = os.path.basename(executable or argv[0])
    try:
        child = subprocess.Popen(list(argv), executable=executable, stdin=subprocess.DEVNULL,
                                 stdout=stdout, stderr=stderr,
                                 env=dict(env) if env is not None else None, cwd=cwd,
                                 start_new_session=new_session, close_fds=True, shell=False)
    except OSError:
        stats.record(name, failed=True)
        raise
    stats.record(name)
    return child


def resolve(program: str, path: str | None = None) -> str:
    """Return the absolute path of ``program``, so argv[0] is never looked up by the shell."""
    if os.sep in program:
        return program
    found = shutil.which(program, path=path)
    if found is None:
        msg = f"{program}: not found on PATH ({path or os.environ.get('PATH', '')})"
        raise CommandError([program], msg)
    return found


class ChildGroup:
    """Children started for one bounded task, so the task's owner can stop them all at its
    deadline instead of waiting for each one's own timeout.

    Each child runs in a session of its own and is killed as a process group, so a wrapper
    script's own children go too and nothing keeps the output pipes open.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.children: dict[int, subprocess.Popen[str]] = {}
        self.started = 0
        self.reaped = 0
        self.killed = False

    def run(self, cmd: Sequence[str], *, timeout: float, env: Mapping[str, str] | None,
            input_text: str | None) -> subprocess.CompletedProcess[str]:
        child = subprocess.Popen(
            list(cmd), stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True)
        with self.lock:
            self.children[child.pid] = child
            self.started += 1
            if self.killed:  # started just after the deadline: stop it at once
                _kill_group(child.pid)
        try:
            try:
                out, err = child.communicate(input_text, timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(child.pid)
                child.communicate()
                raise
        finally:
            child.wait()
            with self.lock:
                del self.children[child.pid]
                self.reaped += 1
                killed = self.killed
        if killed and child.returncode < 0:
            raise subprocess.TimeoutExpired(list(cmd), timeout)
        return subprocess.CompletedProcess(list(cmd), child.returncode, out, err)

    def kill_all(self) -> list[int]:
        """Kill every running child (and any started later); returns the pids killed."""
        with self.lock:
            self.killed = True
            pids = list(self.children)
        for pid in pids:
            _kill_group(pid)
        return pids

    def running(self) -> list[int]:
        """Pids started and not reaped yet."""
        with self.lock:
            return list(self.children)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return


class Runner:
    """Runs argv lists with a timeout; the real implementation of the seam."""

    def __init__(self, env: Mapping[str, str] | None = None, stats: Stats = STATS):
        self.env = dict(env) if env is not None else None
        self.stats = stats

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = True,
        input_text: str | None = None,
        env: Mapping[str, str] | None = None,
        group: ChildGroup | None = None,
    ) -> Completed:
        """Run ``argv``; with ``group`` the child can be killed early by ``group.kill_all``."""
        if not argv:
            raise ValueError("proc.run: empty argv")
        name = os.path.basename(argv[0])
        full_env = self.env if env is None else {**(self.env or os.environ), **env}
        cmd = [resolve(argv[0], (full_env or os.environ).get("PATH")), *argv[1:]]
        start = time.monotonic()
        try:
            if group is not None:
                cp = group.run(cmd, timeout=timeout, env=full_env, input_text=input_text)
            else:
                cp = subprocess.run(
                    cmd,
                    shell=False,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    input=input_text,
                    env=full_env,
                    check=False,
                    stdin=None if input_text is not None else subprocess.DEVNULL,
                )
        except subprocess.TimeoutExpired as exc:
            self.stats.record(name, failed=True, timed_out=True)
            log.warning("command timed out", argv=list(argv), timeout=timeout)
            raise CommandTimeout(argv, f"timed out after {timeout:g}s") from exc
        except OSError as exc:
            self.stats.record(name, failed=True)
            raise CommandError(argv, f"couldn't start: {exc}") from exc
        elapsed = time.monotonic() - start
        result = Completed(tuple(argv), cp.returncode, cp.stdout, cp.stderr, elapsed)
        failed = cp.returncode != 0
        self.stats.record(name, failed=failed)
        log.debug("command", argv=list(argv), rc=cp.returncode, seconds=round(elapsed, 3))
        if failed and check:
            detail = (cp.stderr or cp.stdout).strip() or f"exit status {cp.returncode}"
            raise CommandError(argv, detail, result)
        return result
