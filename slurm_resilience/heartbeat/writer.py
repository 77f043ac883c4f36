"""Training side: a rank's memory-mapped heartbeat slot.

A beat is one clock read and three ``struct.pack_into`` writes into shared
memory: no syscall, no lock, no thread. It proves the training loop itself is
progressing, which a background thread could not.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import time
from collections.abc import Iterator
from typing import NamedTuple

from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.heartbeat import slot as S

_EWMA_ALPHA = 0.1


def process_start_ticks(pid: int | str = "self") -> int:
    """Field 22 of ``/proc/PID/stat``: with the pid it identifies a process across pid reuse."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        data = fh.read()
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = data[data.rindex(b")") + 2:].split()
    return int(rest[19])


class Progress(NamedTuple):
    """A rank's loop as its own process sees it: beats so far, the last beat's step and
    monotonic time, the smoothed step time, whether it is inside a section, whether the
    loop is over (done, or stopping on purpose), and the job's own step timeout (0: none)."""

    beats: int
    step: int
    last: float
    step_s: float
    in_section: bool
    over: bool
    step_timeout_s: float


class Heartbeat:
    """The writer of one rank's slot. Not thread-safe: call from the training loop."""

    def __init__(self, path: str, *, rank: int, world_size: int, local_rank: int = 0,
                 job_id: int = 0, restart_count: int = 0, step_timeout_s: float = 0.0,
                 flags: int = 0, clock: Clock = SystemClock()):
        """``clock`` is injectable so tests need not sleep."""
        if not 0 <= rank < world_size:
            raise ValueError(f"heartbeat: rank {rank} is not in [0, {world_size})")
        if not (math.isfinite(step_timeout_s) and step_timeout_s >= 0):
            raise ValueError(f"heartbeat: step timeout {step_timeout_s!r} must be >= 0 seconds")
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, S.SIZE)
            self._mm = mmap.mmap(fd, S.SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # Bound once: beat() reads it as a plain attribute call, the real one without a
        # method of ours in between.
        self._clock = (
            time.monotonic if isinstance(clock, SystemClock) else clock.monotonic)
        now = self._clock()
        self._mm[:] = bytes(S.SIZE)
        self._mm[: S.HEADER.size] = S.encode_header(
            rank=rank, world_size=world_size, local_rank=local_rank, pid=os.getpid(),
            pid_start=process_start_ticks(), job_id=job_id, restart_count=restart_count,
            clock_offset=clock.time() - now, created=now, job_step_timeout_s=step_timeout_s)
        self._flags = flags
        S.FLAGS.pack_into(self._mm, S.FLAGS_OFF, flags)
        S.CKPT.pack_into(self._mm, S.CKPT_OFF, -1)
        S.BEAT.pack_into(self._mm, S.BEAT_OFF, -1, 0.0, 0, 0.0, 0.0, 0.0, 0.0)
        self.rank = rank
        self._seq = 0
        self._last = now
        self._beats = 0
        self._step = -1
        self.step_timeout_s = step_timeout_s
        self._ewma = self._min = self._max = 0.0
        self._sections: list[tuple[str, float]] = []
        self._seq_pack = S.SEQ.pack_into
        self._beat_pack = S.BEAT.pack_into

    # -- the hot path --------------------------------------------------------------------------

    def beat(self, step: int) -> None:
        """Record that ``step`` finished now."""
        now = self._clock()
        dt = now - self._last
        self._last = now
        n = self._beats + 1
        self._step = step  # before the count: a reader that sees n beats sees this step
        self._beats = n
        if n > 2:
            self._ewma += _EWMA_ALPHA * (dt - self._ewma)
            if dt < self._min:
                self._min = dt
            elif dt > self._max:
                self._max = dt
        elif n == 2:  # the first beat's interval includes start-up: not a step time
            self._ewma = self._min = self._max = dt
        seq = self._seq + 2
        self._seq = seq
        mm = self._mm
        self._seq_pack(mm, 96, seq - 1)
        self._beat_pack(mm, 104, step, now, n, dt, self._ewma, self._min, self._max)
        self._seq_pack(mm, 96, seq)

    def progress(self) -> Progress:
        """Where the loop is, for a thread of this process (checkpoint/rescue.py): plain
        attribute reads, retried until the beat count is the same before and after."""
        while True:
            beats = self._beats
            got = Progress(beats, self._step, self._last, self._ewma, bool(self._sections),
                           bool(self._flags & (S.FLAG_DONE | S.FLAG_STOPPED)),
                           self.step_timeout_s)
            if self._beats == beats:
                return got

    # -- rarer events ----------------------------------------------------------------------------

    def _write_section(self, name: str, timeout_s: float) -> None:
        seq = self._seq + 2
        self._seq = seq
        S.SEQ.pack_into(self._mm, S.SEQ_OFF, seq - 1)
        S.SECTION.pack_into(self._mm, S.SECTION_OFF, self._clock(), timeout_s,
                            name.encode("ascii"))
        S.SEQ.pack_into(self._mm, S.SEQ_OFF, seq)

    @contextlib.contextmanager
    def section(self, name: str, timeout_s: float | None = None) -> Iterator[None]:
        """A long phase (``checkpoint``, ``eval``) with its own timeout.

        ``timeout_s`` None uses the cluster's timeout for ``name``. Leaving the
        section counts as progress, so the step timeout restarts from there.
        """
        S.clean_section_name(name)
        if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"heartbeat: section timeout {timeout_s!r} must be > 0 seconds")
        self._sections.append((name, timeout_s or 0.0))
        self._write_section(name, timeout_s or 0.0)
        try:
            yield
        finally:
            self._sections.pop()
            outer = self._sections[-1] if self._sections else ("", 0.0)
            self._write_section(*outer)

    def checkpointed(self, step: int) -> None:
        """Record the newest step saved (or resumed from): the agent holds a job whose
        checkpoint stops advancing between hang restarts."""
        S.CKPT.pack_into(self._mm, S.CKPT_OFF, int(step))

    def _set_flag(self, bit: int, on: bool) -> None:
        self._flags = (self._flags | bit) if on else (self._flags & ~bit)
        S.FLAGS.pack_into(self._mm, S.FLAGS_OFF, self._flags)

    def warmup(self, active: bool = True) -> None:
        """Mark a phase that needs the warm-up timeout (e.g. recompilation after a resume)."""
        self._set_flag(S.FLAG_WARMUP, active)

    def done(self) -> None:
        """The training loop ended: the agent stops expecting beats from this rank."""
        if self._mm.closed:  # already closed: nothing left to tell the agent
            return
        self._set_flag(S.FLAG_DONE, True)

    def stopping(self) -> None:
        """The loop is saving to stop on purpose (time limit ahead, preemption): goodput
        counts the rest of the run as a planned restart; beats are still watched."""
        if not self._mm.closed:
            self._set_flag(S.FLAG_STOPPED, True)

    def stopped(self) -> None:
        """The loop saved and stopped on purpose (time limit ahead, preemption): done, and a
        planned restart for goodput."""
        if self._mm.closed:
            return
        self._set_flag(S.FLAG_DONE | S.FLAG_STOPPED, True)

    def close(self) -> None:
        if not self._mm.closed:
            self._mm.close()
