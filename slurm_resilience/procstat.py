"""``/proc/<pid>/stat``, read once for every module that identifies processes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Proc:
    """A process, identified by pid and start time (so a recycled pid is never signalled)."""

    pid: int
    ppid: int
    start: int
    comm: str
    tty: int = 0


def read_proc(pid: int, proc: str = "/proc") -> Proc | None:
    """``/proc/<pid>/stat`` as a :class:`Proc`; None when gone or a zombie."""
    try:
        with open(f"{proc}/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    head, _, tail = stat.rpartition(")")
    rest = tail.split()
    if len(rest) < 20 or rest[0] in ("Z", "X"):
        return None
    return Proc(pid, int(rest[1]), int(rest[19]), head.partition("(")[2], int(rest[4]))
