"""Structured logging for hooks, daemons and the CLI.

The package never touches structlog's global configuration or the root logger,
so a training script that imports ``slurm_resilience`` keeps its own logging.
Our loggers share a small mutable state that :func:`configure` fills in:

* hooks and daemons: JSON lines to a file and to syslog (journald picks it up);
* the CLI: human-readable lines on stderr.

Every event carries ``component`` and, once known, ``node`` and ``job_id``.
Loggers are structlog-style (``logger.info("event", key=value)``, ``bind``) but
built here on the standard library: structlog's import (asyncio, ssl) cost the
prolog, which runs on every job's critical path, about a quarter of its time.
Values under secret-looking keys are replaced before rendering, and every string is
escaped to one printable, bounded line (users control job names, comments, options).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import syslog
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, TextIO

LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "critical": 50}
_METHOD_LEVEL = {**LEVELS, "exception": 40, "msg": 20, "fatal": 50}
_LEVEL_NAME = {"warn": "warning", "exception": "error", "msg": "info", "fatal": "critical"}
_SYSLOG_PRIORITY = {
    10: syslog.LOG_DEBUG,
    20: syslog.LOG_INFO,
    30: syslog.LOG_WARNING,
    40: syslog.LOG_ERR,
    50: syslog.LOG_CRIT,
}

SECRET_KEY = re.compile(
    r"(secret|passw|token|credential|access_key|private_key|authorization|session_key|api_key)",
    re.IGNORECASE,
)
_URL_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)
REDACTED = "***"

EventDict = MutableMapping[str, Any]


@dataclass
class _State:
    level: int = 30
    json: bool = False
    context: dict[str, object] = field(default_factory=dict)
    stream: TextIO | None = None
    file: TextIO | None = None
    syslog: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


_state = _State()


def _after_fork_in_child() -> None:
    # A fork from a threaded process (the agent running collectors) may copy the lock
    # while another thread holds it; the child gets a fresh one so it can log.
    _state.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def redact(value: Any, key: str = "") -> Any:
    """Return ``value`` with secrets removed: secret-named keys and URL credentials."""
    if key and SECRET_KEY.search(key):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _URL_USERINFO.sub(r"\1***@", value)
    return value


def _add_context(_: Any, method: str, event: EventDict) -> EventDict:
    for key, value in _state.context.items():
        event.setdefault(key, value)
    return event


class DropEvent(Exception):
    """Raised by a processor to drop the event (below the configured level)."""


def _filter_level(_: Any, method: str, event: EventDict) -> EventDict:
    level = _METHOD_LEVEL.get(method, 20)
    if level < _state.level:
        raise DropEvent
    event["level"] = _LEVEL_NAME.get(method, method)
    return event


def _exc(_: Any, method: str, event: EventDict) -> EventDict:
    exc_info = event.pop("exc_info", None)
    if exc_info:
        if not isinstance(exc_info, tuple):
            exc_info = sys.exc_info()
        if exc_info[0] is not None:
            import traceback

            event["exception"] = "".join(traceback.format_exception(*exc_info)).rstrip("\n")
    return event


def _timestamper(_: Any, method: str, event: EventDict) -> EventDict:
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
    event["timestamp"] = f"{stamp}.{int(now % 1 * 1e6):06d}Z"
    return event


MAX_VALUE = 4096  # characters of one string value; users control job names, comments, options


def escape(text: str, limit: int = MAX_VALUE) -> str:
    """One printable line, bounded: newlines, escape sequences and other control or
    invisible characters (U+2028, bidi overrides) become ``\\n``, ``\\x1b``, ``\\u2028``,
    so what a user put in a job name can't start a line of its own or hide text."""
    if len(text) > limit:
        text = text[:limit] + f"...[{len(text) - limit} more]"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _bound(value: Any) -> Any:
    if isinstance(value, str):
        return escape(value) if len(value) > MAX_VALUE else value
    if isinstance(value, dict):
        return {k: _bound(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_bound(v) for v in value]
    return value


def _escape(_: Any, method: str, event: EventDict) -> EventDict:
    # Both renderers escape values (json.dumps; the console's repr), not the event text,
    # which may quote a user's value: that is escaped here, and every value is bounded.
    for key in list(event):
        event[key] = _bound(event[key])
    if isinstance(event.get("event"), str):
        event["event"] = escape(event["event"])
    return event


def _redact(_: Any, method: str, event: EventDict) -> EventDict:
    for key in list(event):
        if key != "event":
            event[key] = redact(event[key], key)
    event["event"] = redact(event.get("event", ""))
    return event


_QUOTE = frozenset(" \t=\r\n\"'")


def _console_value(value: Any) -> str:
    if isinstance(value, str) and not (set(value) & _QUOTE):
        return value
    return repr(value)


def _console(event: EventDict) -> str:
    """``<time> [<level>] <event> key=value ...``, keys sorted; a traceback below."""
    exc = event.pop("exception", None)
    head = (f"{event.pop('timestamp', '')} [{event.pop('level', ''):<9}] "
            f"{event.pop('event', '')!s:<30}")
    pairs = " ".join(f"{k}={_console_value(v)}" for k, v in sorted(event.items()))
    line = f"{head} {pairs}".rstrip()
    return f"{line}\n{exc}" if exc else line


def _render(logger: Any, method: str, event: EventDict) -> str:
    if _state.json:
        return json.dumps(event, default=str, sort_keys=False)
    return _console(event)


class _Router:
    """Sends each rendered line to the configured sinks."""

    def emit(self, line: str, level: int) -> None:
        with _state.lock:
            for stream in (_state.stream, _state.file):
                if stream is not None:
                    try:
                        stream.write(line + "\n")
                        stream.flush()
                    except (OSError, ValueError) as exc:
                        _sink_failed(stream, exc, line)
        if _state.syslog:
            syslog.syslog(_SYSLOG_PRIORITY.get(level, syslog.LOG_INFO), line)


def _sink_failed(stream: TextIO, exc: Exception, line: str) -> None:
    """A full or broken log disk must never fail a hook (slurmd would drain the node with
    its own reason): the file is dropped, said once on stderr, and logging goes on there."""
    if stream is _state.file:
        _state.file = None
        with contextlib.suppress(OSError, ValueError):
            stream.close()
        if _state.stream is None:
            _state.stream = sys.stderr
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(json.dumps({"event": "log: couldn't write the log file; logging "
                                         "to stderr from here on", "error": str(exc)}) + "\n")
            sys.stderr.write(line + "\n")
    # stderr itself failing (closed by the caller): nothing left to tell; never raise.


_ROUTER = _Router()
_PROCESSORS: list[Callable[[Any, str, EventDict], Any]] = [
    _add_context, _filter_level, _exc, _timestamper, _redact, _escape, _render]


class Logger:
    """A logger with bound context: ``logger.warning("event", key=value)``.

    The event dict is the bound context, then the call's keys, then ``event``; the
    processors above add the process context, level and time, redact, escape and render.
    """

    def __init__(self, context: dict[str, object]):
        self._context = context

    def bind(self, **context: Any) -> Logger:
        return Logger({**self._context, **context})

    def unbind(self, *keys: str) -> Logger:
        return Logger({k: v for k, v in self._context.items() if k not in keys})

    try_unbind = unbind

    def new(self, **context: Any) -> Logger:
        return Logger(dict(context))

    def _log(self, method: str, event: str | None, fields: dict[str, object]) -> None:
        if _METHOD_LEVEL.get(method, 20) < _state.level:
            return  # cheap early exit: below the level, nothing is built
        data: Any = {**self._context, **fields, "event": event}
        try:
            for processor in _PROCESSORS:
                data = processor(None, method, data)
        except DropEvent:
            return
        _ROUTER.emit(data, _METHOD_LEVEL.get(method, 20))

    def debug(self, event: str | None = None, **fields: Any) -> None:
        self._log("debug", event, fields)

    def info(self, event: str | None = None, **fields: Any) -> None:
        self._log("info", event, fields)

    def msg(self, event: str | None = None, **fields: Any) -> None:
        self._log("msg", event, fields)

    def warning(self, event: str | None = None, **fields: Any) -> None:
        self._log("warning", event, fields)

    warn = warning

    def error(self, event: str | None = None, **fields: Any) -> None:
        self._log("error", event, fields)

    def exception(self, event: str | None = None, **fields: Any) -> None:
        """An error with the exception being handled (its traceback)."""
        fields.setdefault("exc_info", True)
        self._log("exception", event, fields)

    def critical(self, event: str | None = None, **fields: Any) -> None:
        self._log("critical", event, fields)

    fatal = critical


def get_logger(component: str, **context: Any) -> Logger:
    """A logger bound to ``component``; cheap to create at import time."""
    return Logger({"component": component, **context})


def configure(
    *,
    mode: str = "cli",
    level: str = "warning",
    file: str | None = None,
    use_syslog: bool = False,
    **context: Any,
) -> None:
    """Set where and how every slurm-resilience logger writes.

    ``mode="cli"`` renders readable lines on stderr; ``mode="json"`` writes JSON
    lines to ``file`` (and stderr only when no file is given).
    """
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: valid levels are {', '.join(LEVELS)}")
    with _state.lock:
        if _state.file is not None:
            with contextlib.suppress(OSError, ValueError):  # a full disk fails the flush
                _state.file.close()
        _state.level = LEVELS[level]
        _state.json = mode == "json"
        _state.file = None
        opened = None
        if file:
            try:
                os.makedirs(os.path.dirname(file) or ".", exist_ok=True)
                opened = open(file, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
            except OSError as exc:  # a broken log disk must not stop a hook: stderr instead
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.write(json.dumps({"event": "log: couldn't open the log file; "
                                                 "logging to stderr", "file": file,
                                                 "error": str(exc)}) + "\n")
        _state.file = opened
        _state.stream = sys.stderr if (mode == "cli" or opened is None) else None
        _state.syslog = use_syslog and os.path.exists("/dev/log")
        if _state.syslog:
            syslog.openlog("slurm-resilience", syslog.LOG_PID, syslog.LOG_DAEMON)
        _state.context = {k: v for k, v in context.items() if v is not None}


def bind_context(**context: Any) -> None:
    """Add fields (``node``, ``job_id``) that every later event carries."""
    with _state.lock:
        _state.context.update({k: v for k, v in context.items() if v is not None})


def reset() -> None:
    """Back to the quiet default: warnings and errors on stderr. For tests."""
    configure()


_state.stream = sys.stderr
