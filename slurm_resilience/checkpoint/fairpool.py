"""A thread pool that serves jobs in turn, so one job's big restore can't starve another's.

``ckpt.fetch`` queues one task per block; a plain FIFO pool would run every block
of a 1 TB restore before the first block of a small job queued after it. Here
each job has its own queue and idle workers take the next task round-robin
across jobs with work.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
_Task = tuple[Callable[..., Any], tuple[Any, ...], "Future[Any]"]


class FairPool:
    def __init__(self, workers: int, name: str = "fair") -> None:
        self._queues: dict[int, deque[_Task]] = {}
        self._turns: deque[int] = deque()  # jobs with queued work, next first
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, key: int, fn: Callable[..., T], *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("pool is shut down")
            queue = self._queues.setdefault(key, deque())
            if not queue:
                self._turns.append(key)
            queue.append((fn, args, fut))
            self._cond.notify()
        return fut

    def _next(self) -> _Task | None:
        with self._cond:
            while not self._turns and not self._closed:
                self._cond.wait()
            if not self._turns:
                return None
            key = self._turns.popleft()
            queue = self._queues[key]
            task = queue.popleft()
            if queue:
                self._turns.append(key)  # back of the line: others go first
            else:
                del self._queues[key]
            return task

    def _work(self) -> None:
        while (task := self._next()) is not None:
            fn, args, fut = task
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def shutdown(self) -> None:
        """Stop taking work; queued tasks are cancelled, running ones finish."""
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for _fn, _args, fut in queue:
                    fut.cancel()
            self._queues.clear()
            self._turns.clear()
            self._cond.notify_all()
