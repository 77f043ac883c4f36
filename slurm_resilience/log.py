"""Structured logging for hooks, daemons and the CLI.

The package never touches structlog's global configuration or the root logger,
so a training script that imports ``slurm_resilience`` keeps its own logging.
Our loggers share a small mutable state that :func:`configure` fills in:

* hooks and daemons: JSON lines to a file and to syslog (journald picks it up);
* the CLI: human-readable lines on stderr.

Every event carries ``component`` and, once known, ``node`` and ``job_id``.
Values under secret-looking keys are replaced before rendering, and every string is
escaped to one printable, bounded line (users control job names, comments, options).
"""

from __future__ import annotations

import json
import os
import re
import sys
import syslog
import threading
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, TextIO

import structlog

LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "critical": 50}
_METHOD_LEVEL = {**LEVELS, "exception": 40, "msg": 20, "fatal": 50}
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
    context: dict[str, Any] = field(default_factory=dict)
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


def _filter_level(_: Any, method: str, event: EventDict) -> EventDict:
    level = _METHOD_LEVEL.get(method, 20)
    if level < _state.level:
        raise structlog.DropEvent
    event["level"] = "error" if method == "exception" else method
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
    event["event"] = escape(str(event.get("event", "")))
    return event


def _redact(_: Any, method: str, event: EventDict) -> EventDict:
    for key in list(event):
        if key != "event":
            event[key] = redact(event[key], key)
    event["event"] = redact(event.get("event", ""))
    return event


_timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
_exc = structlog.processors.format_exc_info
_console = structlog.dev.ConsoleRenderer(colors=False)


def _render(logger: Any, method: str, event: EventDict) -> str:
    if _state.json:
        return json.dumps(event, default=str, sort_keys=False)
    return str(_console(logger, method, event))


class _Router:
    """The structlog 'logger': sends each rendered line to the configured sinks."""

    def _emit(self, line: str, level: int) -> None:
        with _state.lock:
            for stream in (_state.stream, _state.file):
                if stream is not None:
                    stream.write(line + "\n")
                    stream.flush()
        if _state.syslog:
            syslog.syslog(_SYSLOG_PRIORITY.get(level, syslog.LOG_INFO), line)

    def __getattr__(self, name: str) -> Callable[[str], None]:
        level = _METHOD_LEVEL.get(name, 20)
        return lambda line: self._emit(line, level)


_ROUTER = _Router()
_PROCESSORS: list[Any] = [_add_context, _filter_level, _exc, _timestamper, _redact, _escape,
                          _render]


def get_logger(component: str, **context: Any) -> Any:
    """A logger bound to ``component``; cheap to create at import time."""
    return structlog.wrap_logger(
        _ROUTER,
        processors=_PROCESSORS,
        context_class=dict,
        cache_logger_on_first_use=False,
    ).bind(component=component, **context)


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
            _state.file.close()
        _state.level = LEVELS[level]
        _state.json = mode == "json"
        _state.file = None
        if file:
            os.makedirs(os.path.dirname(file) or ".", exist_ok=True)
            _state.file = open(file, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
        _state.stream = sys.stderr if (mode == "cli" or not file) else None
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
