"""When the NCCL test runs, and the node lock that keeps it from racing a job.

The prolog decides from the cache, cheaply: it runs the test only when the job
has the whole node AND (the cached result is stale, or the node has just come
back to service, or the job asks for it). Everything else is left to idle-node
verification: the periodic health run starts the test in the background on an
idle node, holding the node lock. A job that arrives meanwhile takes the node
back: its prolog signals the holder, which kills its ranks and lets go (the
"hand-off"), so the job waits only for that, never for the test.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.log import get_logger

log = get_logger("nccl")

ASK_VARS = ("SLURM_RESILIENCE_NCCL_TEST", "SPANK_SLURM_RESILIENCE_NCCL_TEST")
_TRUE = ("1", "yes", "true", "on")
LOCK_NAME = "nccl.lock"
# Only a process whose command line says it is ours may be signalled by the hand-off:
# idle verification (python -m slurm_resilience.nccl.verify), `slurm-resilience nccl-test`,
# or the idle active diagnostics (python -m slurm_resilience.health.idle_diag).
OUR_MARKS = (b"slurm_resilience.nccl", b"nccl-test", b"slurm_resilience.health.idle_diag")


def job_asks(env: Mapping[str, str], always: bool = False) -> bool:
    """The job asked for the test: config, or ``SLURM_RESILIENCE_NCCL_TEST=1`` in the
    prolog's environment (directly, or as a SPANK option's ``SPANK_`` variable)."""
    return always or any(env.get(v, "").strip().lower() in _TRUE for v in ASK_VARS)


@dataclass(frozen=True)
class Decision:
    run: bool
    why: str


def decide_prolog(*, enabled: bool, fresh: bool, stale_why: str, asks: bool) -> Decision:
    """Pure, and cheap first: the whole-node question (a slurmctld call) is asked
    only when this says the test would otherwise run."""
    if not enabled:
        return Decision(False, "the prolog test is off (nccl.prolog)")
    if asks:
        return Decision(True, "the job asks for the test")
    if not fresh:
        return Decision(True, stale_why)
    return Decision(False, stale_why)


def idle_due(*, fresh: bool, age_s: float | None, interval_s: float) -> bool:
    """Pure: idle verification is due when the result is stale or older than the interval."""
    return not fresh or age_s is None or age_s >= interval_s


# -- the node lock -----------------------------------------------------------------------


def _open_lock(path: str) -> int:
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


class NodeLock:
    """An flock on ``<run_dir>/nccl.lock`` whose file names the holder's pid.

    ``clock`` times the waits (tests pass a fake one that advances on sleep).
    """

    def __init__(self, path: str, *, clock: Clock = SystemClock()):
        self.path = path
        self.fd: int | None = None
        self.clock = clock

    def try_acquire(self) -> bool:
        fd = _open_lock(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return True

    def acquire(self, timeout_s: float, poll_s: float = 0.01) -> bool:
        deadline = self.clock.monotonic() + timeout_s
        while not self.try_acquire():
            if self.clock.monotonic() >= deadline:
                return False
            self.clock.sleep(poll_s)
        return True

    def release(self) -> None:
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> NodeLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_pid(path: str) -> int | None:
    """The pid written by the lock's holder, if any."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else None


def _is_ours(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read()
    except OSError:
        return False
    return any(mark in cmdline for mark in OUR_MARKS)


@dataclass(frozen=True)
class Handoff:
    """What taking the node from a running test took; ``locked``: the lock is ours now."""

    held: bool
    seconds: float
    holder: int | None = None
    forced: bool = False
    locked: bool = True


def take_over(lock: NodeLock, timeout_s: float) -> Handoff:
    """Acquire the node lock for a job. If one of our tests holds it (idle verification,
    or ``nccl-test`` by hand), ask it to stop (SIGTERM: it kills its ranks and lets go),
    wait up to ``timeout_s``, and past that kill it. A holder that is not ours is never
    signalled nor waited for: the job goes on and the caller runs no test."""
    started = lock.clock.monotonic()
    if lock.try_acquire():
        return Handoff(False, lock.clock.monotonic() - started)
    pid = holder_pid(lock.path)
    if pid is None and lock.acquire(min(0.2, timeout_s)):  # the holder was just letting go
        return Handoff(False, lock.clock.monotonic() - started)
    if pid is None or not _is_ours(pid):
        log.warning("nccl: node lock held by a process that is not ours; not waiting",
                    holder=pid, lock=lock.path)
        return Handoff(True, lock.clock.monotonic() - started, pid, locked=False)
    # Gone already: it finished on its own and the lock is about to be free.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    forced = False
    if not lock.acquire(timeout_s):
        forced = True
        if _is_ours(pid):
            log.error("nccl: handoff: the running test did not stop; killing it", pid=pid,
                      timeout_s=timeout_s)
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signal.SIGKILL)
        lock.acquire(1.0)
    seconds = lock.clock.monotonic() - started
    log.info("nccl: took the node back from idle verification", holder=pid,
             seconds=round(seconds, 3), forced=forced)
    return Handoff(True, seconds, pid, forced, lock.fd is not None)
