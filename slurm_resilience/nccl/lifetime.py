"""What the healthcheck starts never outlives slurmd (or the node agent).

Idle verification is started detached, so slurmd's limit on the health run never
cuts the test short; but detached, it would run on after slurmd is stopped (a
node taken out of service, ``sandbox down``). ``PR_SET_PDEATHSIG`` cannot help:
the parent is the health run, which exits at once. So the healthcheck names the
verifier's *owner*, the outermost ``slurmd`` (or agent) above it, by pid and
start time (a recycled pid is not the owner), and the verifier watches it: once
the owner is gone it stops its ranks (which follow their parent) and exits.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from slurm_resilience.log import get_logger
from slurm_resilience.procstat import read_proc

log = get_logger("nccl")

# Processes that own what the healthcheck starts: slurmd (HealthCheckProgram's parent)
# and the node agent, should it run the healthcheck.
OWNER_COMMS = frozenset({"slurmd"})
POLL_S = 0.5
# After the owner is gone: time to stop the ranks and let go of the lock, then exit anyway.
EXIT_GRACE_S = 10.0


@dataclass(frozen=True)
class Owner:
    """A process by pid and start time (clock ticks since boot, /proc/<pid>/stat field 22)."""

    pid: int
    start: int

    def arg(self) -> str:
        return f"{self.pid}:{self.start}"

    @classmethod
    def parse(cls, text: str) -> Owner:
        pid, sep, start = text.partition(":")
        if not (sep and pid.isdigit() and start.isdigit()):
            raise ValueError(f"owner {text!r} is not PID:START")
        return cls(int(pid), int(start))


def _is_agent(pid: int, proc: str) -> bool:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return False
    names = {os.path.basename(a) for a in argv[:3]}
    return bool(names & {"slurm_resilience", "slurm-resilience"}) and "agent" in argv


def find_owner(pid: int | None = None, proc: str = "/proc") -> Owner | None:
    """The outermost slurmd (or node agent) among ``pid``'s ancestors; None when run by
    hand. Outermost, because slurmd forks a short-lived copy of itself to run the script."""
    found: Owner | None = None
    seen: set[int] = set()
    if pid is None:
        here = os.getppid()
    else:
        st = read_proc(pid, proc)
        here = st.ppid if st else 0
    while here > 1 and here not in seen:
        seen.add(here)
        st = read_proc(here, proc)
        if st is None:
            break
        if st.comm in OWNER_COMMS or _is_agent(here, proc):
            found = Owner(here, st.start)
        here = st.ppid
    return found


def alive(owner: Owner, proc: str = "/proc") -> bool:
    st = read_proc(owner.pid, proc)
    return st is not None and st.start == owner.start


def watch(owner: Owner, on_gone: Callable[[], None], *, poll_s: float = POLL_S,
          exit_grace_s: float = EXIT_GRACE_S,
          exit: Callable[[int], None] = os._exit) -> threading.Thread:
    """Call ``on_gone`` once ``owner`` has ended, then ``exit(EXIT_OWNER_GONE)`` if the
    process is still there ``exit_grace_s`` later (a backstop behind ``on_gone``)."""

    def loop() -> None:
        while alive(owner):
            time.sleep(poll_s)
        log.warning("nccl: the process that started this has ended; stopping",
                    owner=owner.pid)
        on_gone()
        time.sleep(exit_grace_s)
        exit(EXIT_OWNER_GONE)

    thread = threading.Thread(target=loop, name="watch-owner", daemon=True)
    thread.start()
    return thread


EXIT_OWNER_GONE = 4
