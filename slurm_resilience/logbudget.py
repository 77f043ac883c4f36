"""A budget of log lines for events users can trigger, so root's logs can't be flooded.

A user controls how often root code refuses their slot files, their requests or their
credentials. :class:`LogBudget` lets ``lines`` lines through per key (a job, a uid, a peer)
and window, counts the rest, and says once, when the window ends, how many there were::

    4,096 refused heartbeat slots of job 12 in the last minute (4,086 not logged)

Keys are bounded too: past ``max_keys`` keys in a window, new keys share one "other keys"
entry, so a user who varies the key (job ids, peers) gets no more lines. A window ends
when the budget is next used or :func:`flush_all` runs (the agent's loop calls it each
tick). :func:`user_text` cuts a user's text short and escapes it for a log field.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.log import Logger, escape

# Characters of a user's text (a payload, a path, a reason quoting them) kept in one field.
USER_TEXT_LIMIT = 200
OTHER_KEYS = "other keys"

_LEVELS = ("debug", "info", "warning", "error")


def user_text(value: object, limit: int = USER_TEXT_LIMIT) -> str:
    """``value`` as one short, printable line: cut at ``limit`` characters, then escaped."""
    return escape(str(value), limit)


@dataclass
class _Window:
    start: float
    seen: int = 0
    logged: int = 0


@dataclass(frozen=True)
class BudgetStats:
    """Counters for tests and metrics: events seen, lines written, summaries written."""

    events: int
    lines: int
    summaries: int
    keys: int


class LogBudget:
    """At most ``lines`` lines per key and ``window_s``, then one summary line per key.

    ``what`` names the events in the summary ("refused heartbeat slots"); the key names who
    caused them ("job 12", "uid 1002", "peer 10.0.0.5"). ``clock`` gives the monotonic time.
    """

    def __init__(self, logger: Logger, what: str, *, lines: int = 10, window_s: float = 60.0,
                 max_keys: int = 256, level: str = "warning",
                 clock: Clock = SystemClock()):
        if level not in _LEVELS:
            raise ValueError(f"log budget: level {level!r}: valid levels are "
                             f"{', '.join(_LEVELS)}")
        if lines < 1 or window_s <= 0 or max_keys < 1:
            raise ValueError("log budget: lines and max_keys must be at least 1, window_s > 0")
        self.logger, self.what, self.level = logger, what, level
        self.lines, self.window_s, self.max_keys = lines, window_s, max_keys
        self.clock = clock
        self._windows: dict[str, _Window] = {}  # insertion order is start order
        self._lock = threading.Lock()
        self._events = self._lines = self._summaries = 0
        _BUDGETS.add(self)

    def log(self, key: object, event: str, *, level: str | None = None, **fields: Any) -> bool:
        """Log ``event`` (at the budget's level, or ``level``) unless ``key`` spent its lines
        in this window; True when the line was written."""
        now = self.clock.monotonic()
        name = str(key)
        with self._lock:
            due = self._take_due(now)
            window = self._windows.get(name)
            if window is None:
                if len(self._windows) >= self.max_keys - 1:  # one left for the rest
                    name = OTHER_KEYS
                    window = self._windows.get(name)
                if window is None:
                    window = self._windows[name] = _Window(now)
            window.seen += 1
            self._events += 1
            write = window.logged < self.lines
            if write:
                window.logged += 1
                self._lines += 1
        self._summarize(due, now)
        if write:
            getattr(self.logger, level or self.level)(event, **fields)
        return write

    def flush(self) -> int:
        """Write the summaries of windows that have ended; returns how many were written."""
        now = self.clock.monotonic()
        with self._lock:
            due = self._take_due(now)
        return self._summarize(due, now)

    def stats(self) -> BudgetStats:
        with self._lock:
            return BudgetStats(self._events, self._lines, self._summaries, len(self._windows))

    def _take_due(self, now: float) -> list[tuple[str, _Window]]:
        due = []
        while self._windows:  # oldest first: later entries started later
            name, window = next(iter(self._windows.items()))
            if now - window.start < self.window_s:
                break
            del self._windows[name]
            if window.seen > window.logged:
                due.append((name, window))
        self._summaries += len(due)
        return due

    def _summarize(self, due: list[tuple[str, _Window]], now: float) -> int:
        for name, window in due:
            held = window.seen - window.logged
            event = (f"{window.seen:,} {self.what} of {name} in the last "
                     f"{_span(now - window.start)} ({held:,} not logged)")
            getattr(self.logger, self.level)(event, summary=True, key=name,
                                             count=window.seen, not_logged=held)
        return len(due)


def _span(seconds: float) -> str:
    if seconds < 90:
        return "minute" if seconds >= 55 else f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} minutes"


_BUDGETS: weakref.WeakSet[LogBudget] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A fork from the threaded agent may copy a budget's lock while another thread holds it.
    for budget in list(_BUDGETS):
        budget._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def flush_all() -> int:
    """Write the due summaries of every budget in this process (the agent, each tick)."""
    return sum(budget.flush() for budget in list(_BUDGETS))
