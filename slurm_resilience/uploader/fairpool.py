"""A fixed set of worker threads shared by every job's uploads, fair between jobs.

Each job (owner) has its own queue; a free worker takes the next task of the owner
served least recently (an owner new to the pool first), so a job with 10,000 parts
queued and one with 2 alternate part by part: the small one waits at most one
part of each other job per part of its own, never for the big one to finish.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class FairPool:
    """Round-robin across owners; tasks of one owner run in submission order."""

    def __init__(self, workers: int, name: str = "fair"):
        if workers < 1:
            raise ValueError(f"fairpool: workers {workers} must be at least 1")
        self._queues: dict[str, deque[tuple[Future[Any], Callable[[], Any]]]] = {}
        self._served: dict[str, int] = {}  # owner -> when it was last served (a counter)
        self._clock = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, owner: str, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("fairpool: couldn't submit: the pool is closed")
            self._queues.setdefault(owner, deque()).append((fut, fn))
            self._cond.notify()
        return fut

    def _next(self) -> tuple[Future[Any], Callable[[], Any]] | None:
        with self._cond:
            while not self._queues and not self._closed:
                self._cond.wait()
            if not self._queues:
                return None
            owner = min(self._queues, key=lambda o: self._served.get(o, -1))
            queue = self._queues[owner]
            task = queue.popleft()
            if not queue:
                del self._queues[owner]
            self._served[owner] = next(self._clock)
            if len(self._served) > 4096:  # owners come and go: forget idle ones
                self._served = {o: self._served[o] for o in self._queues if o in self._served}
                self._served[owner] = next(self._clock)
            return task

    def _work(self) -> None:
        while True:
            task = self._next()
            if task is None:
                return
            fut, fn = task
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter, never lost
                fut.set_exception(exc)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for fut, _ in queue:
                    fut.cancel()
            self._queues.clear()
            self._cond.notify_all()
