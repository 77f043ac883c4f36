"""One owner thread per piece of mutable state, fed by a queue of commands.

The uploader's journal records (and the bookkeeping that goes with them) are read and
changed by one thread only, the owner. Every other thread (request handlers, the sync,
stage-in, retention and space workers) sends it a :class:`Command` and, for a reply,
waits a bounded time: a caller whose command the owner doesn't answer in time gets
:class:`OwnerTimeout`, which names the command the owner is still busy with.

The owner runs commands one at a time, in the order they came; a command that raises
hands its exception to its caller, and the owner goes on. A command sent from the owner
itself (one command composing another) runs at once, in place.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Generic, TypeVar

from slurm_resilience.log import get_logger

T = TypeVar("T")
S = TypeVar("S")


log = get_logger("owner")


def _log_failure(fut: Future[T]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        exc = fut.exception()
        log.error("a queued command failed on the owner thread", error=repr(exc))


class NotOwnerThread(RuntimeError):
    """State owned by one thread was about to be changed from another."""


class OwnerTimeout(RuntimeError):
    """The owner didn't answer a command within the caller's bound."""


class OwnerStopped(RuntimeError):
    """The owner was stopped (the service is closing); it runs no more commands."""


class Command(Generic[S, T]):
    """A typed request to the owner of state ``S``, answered with a ``T``; subclasses
    are small dataclasses whose ``apply`` runs on the owner thread."""

    def apply(self, state: S) -> T:
        raise NotImplementedError


@dataclass
class _Slot(Generic[S, T]):
    command: Command[S, T]
    future: Future[T]


class _Stop:
    pass


class Owner(Generic[S]):
    """The thread that owns ``state``: it alone applies commands to it."""

    def __init__(self, state: S, name: str, timeout_s: float):
        self.state = state
        self.name = name
        self.timeout_s = timeout_s  # how long a caller waits for an answer by default
        self._queue: queue.SimpleQueue[_Slot[S, object] | _Stop] = queue.SimpleQueue()
        self._busy: tuple[str, float] | None = None  # the command running, since when
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def check(self, what: str) -> None:
        """Raise NotOwnerThread unless called on the owner thread (the mutation helpers
        call this first: a worker never changes what the owner holds)."""
        if threading.current_thread() is not self._thread:
            raise NotOwnerThread(f"{what}: only the owner thread {self.name!r} may do this, "
                                 f"not {threading.current_thread().name!r}; send it a "
                                 "command instead")

    def on_owner(self) -> bool:
        return threading.current_thread() is self._thread

    def ask(self, command: Command[S, T], timeout_s: float | None = None) -> T:
        """Run ``command`` on the owner and return its answer (or raise its exception).
        OwnerTimeout when no answer comes within ``timeout_s`` (the owner's default)."""
        if self.on_owner():
            return command.apply(self.state)
        what = type(command).__name__
        if self._stopped.is_set():
            raise OwnerStopped(f"{self.name}: {what} refused: the owner was stopped "
                               "(the service is closing)")
        fut: Future[T] = Future()
        self._queue.put(_Slot(command, fut))  # type: ignore[arg-type]
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            return fut.result(timeout=limit)
        except FutureTimeout:
            busy = self._busy
            cancelled = fut.cancel()  # not started yet: it never will be
            doing = (f"still busy with {busy[0]} for {time.monotonic() - busy[1]:.1f}s"
                     if busy else "not running any command (stopped or starved)")
            fate = ("it was withdrawn and will not run" if cancelled else
                    "it is running now and its effect stands")
            raise OwnerTimeout(f"{self.name}: no answer to {what} within {limit:g}s: the "
                               f"owner is {doing}; {fate}") from None
        except CancelledError:
            raise OwnerStopped(f"{self.name}: {what} not run: the owner was stopped "
                               "(the service is closing)") from None

    def post(self, command: Command[S, T]) -> Future[T]:
        """Queue ``command`` without waiting for it (the agent's tick must not block);
        an exception it raises is logged, since no caller waits for it."""
        fut: Future[T] = Future()
        if self._stopped.is_set():
            fut.set_exception(OwnerStopped(f"{self.name}: {type(command).__name__} refused: "
                                           "the owner was stopped (the service is closing)"))
            return fut
        fut.add_done_callback(_log_failure)
        self._queue.put(_Slot(command, fut))  # type: ignore[arg-type]
        return fut

    def stop(self, timeout_s: float = 5.0) -> None:
        """Run what is queued, then stop; later commands raise OwnerStopped."""
        self._stopped.set()
        self._queue.put(_Stop())
        if not self.on_owner():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            slot = self._queue.get()
            if isinstance(slot, _Stop):
                break
            if not slot.future.set_running_or_notify_cancel():
                continue  # its caller gave up waiting before it started
            self._busy = (type(slot.command).__name__, time.monotonic())
            try:
                result = slot.command.apply(self.state)
            except BaseException as exc:  # noqa: BLE001 - the caller's to handle, not ours
                slot.future.set_exception(exc)
            else:
                slot.future.set_result(result)
            finally:
                self._busy = None
        while True:  # whatever came after the stop is answered, never left waiting
            try:
                slot = self._queue.get_nowait()
            except queue.Empty:
                return
            if not isinstance(slot, _Stop):
                slot.future.cancel()
