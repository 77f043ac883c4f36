"""Run collectors in forked children with a hard timeout, all at once.

A driver call can hang in uninterruptible sleep; a thread could not be
abandoned, a child process can. Forking (no exec) keeps each start at a few
milliseconds, which the prolog's budget needs. A child past its deadline is
sent SIGKILL and left to be reaped later (one stuck in D-state cannot die).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Outcome:
    """What one collector returned, or why it did not."""

    value: dict[str, Any] | None
    error: str | None
    timed_out: bool
    seconds: float


def _child(fn: Callable[[], dict[str, Any]], fd: int) -> None:
    try:
        payload = json.dumps({"value": fn()})
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        payload = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
    data = payload.encode()
    while data:
        written = os.write(fd, data)
        data = data[written:]


def run_all(jobs: dict[str, Callable[[], dict[str, Any]]], timeout: float
            ) -> dict[str, Outcome]:
    """Run every job in its own child; return when all finished or the deadline passed."""
    started = time.monotonic()
    deadline = started + timeout
    running: dict[int, tuple[str, int, bytearray]] = {}  # read fd -> (name, pid, buffer)
    results: dict[str, Outcome] = {}
    for name, fn in jobs.items():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            code = 0
            try:
                os.close(r)
                _child(fn, w)
            except BaseException:  # noqa: BLE001 - a child must never return into the caller
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        running[r] = (name, pid, bytearray())
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select(list(running), [], [], left)
        for fd in ready:
            name, pid, buf = running[fd]
            chunk = os.read(fd, 65536)
            if chunk:
                buf.extend(chunk)
                continue
            os.close(fd)
            del running[fd]
            os.waitpid(pid, 0)
            results[name] = _decode(buf, time.monotonic() - started)
    for fd, (name, pid, _) in running.items():
        os.close(fd)
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # already reaped: nothing left to do
            os.waitpid(pid, os.WNOHANG)
        results[name] = Outcome(None, f"no answer within {timeout:g}s", True, timeout)
    return results


def _decode(buf: bytearray, seconds: float) -> Outcome:
    try:
        msg = json.loads(bytes(buf))
    except ValueError:
        return Outcome(None, "collector died without an answer", False, seconds)
    if "error" in msg:
        return Outcome(None, str(msg["error"]), False, seconds)
    return Outcome(msg["value"], None, False, seconds)
